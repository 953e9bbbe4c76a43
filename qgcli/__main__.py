from qgcli.cli import main

main(prog_name="qgcli")
