"""The `gpushare` command line (main.py): every verb but `serve` and `node` talks HTTP to the daemon."""
