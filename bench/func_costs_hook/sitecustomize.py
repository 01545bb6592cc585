"""Python imports this module at start-up in every process whose PYTHONPATH names this
directory first: bench.func_costs starts its cluster's nodes that way (see
bench/func_costs_node.py). Nothing else puts this directory on a path."""

from bench.func_costs_node import start_from_environment

start_from_environment()
