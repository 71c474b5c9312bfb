import sys

from kvmesh.cli import main

sys.exit(main(["serve", "kvmeta", *sys.argv[1:]]))
