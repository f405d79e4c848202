import sys

from kiln.cli import command

sys.exit(command())
