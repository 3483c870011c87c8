"""The front end: one module per subcommand, each its parser, its command and its report (as mlx-lm does);
common.py holds what they share (the parser that suggests, MODEL or --model, --quiet/--debug), engine_flags.py
the budget and engine flags of `run` and `serve`. cli.py only dispatches."""
