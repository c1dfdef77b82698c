"""The exit statuses of the commands (training's `--help` says what each means): 0 done, 1 another error."""

EXIT_BAD_INPUT = 2  # as argparse's usage errors
EXIT_INTERRUPTED = 3
EXIT_NONFINITE = 4
EXIT_NOT_SAVED = 5
