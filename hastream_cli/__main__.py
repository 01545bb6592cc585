"""`python -m hastream_cli ...`: the `hastream` command."""

from hastream_cli.main import main

main()
