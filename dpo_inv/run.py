"""`python -m dpo_inv.run --config CONFIG.yaml [--field value ...]`: training, as `dpo-inv train`; the
module that `accelerate launch -m`, `torchrun -m` and `mpiexec ... python -m` start."""

from dpo_inv.cli import run

if __name__ == "__main__":
    run("train", prog="python -m dpo_inv.run")
