"""`python -m dpo_inv COMMAND [options]`: the commands of `dpo-inv`."""

from dpo_inv.commands import main

main(prog="python -m dpo_inv")
