"""`hastream`: the operator's command line, on top of the Python client (`api_clients`).

    hastream leader 2                 hastream groups          hastream stat
    hastream tables                   hastream create / drop   hastream offsets TOPIC
    hastream remove-offset TOPIC      hastream transfer-leader GROUP [--to NODE]
    hastream status                   hastream tail TABLE      hastream rolling-restart

Every command takes `--sites` (or HASTREAM_SITES, or the client sites of `--config`) and
`--json` for scripts; `hastream COMMAND --help` shows an example. `python -m hastream_cli`
is the same program. Nothing in the node or the client imports this package.
"""
