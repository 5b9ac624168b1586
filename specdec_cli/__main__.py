from specdec_cli.cli import main

main()
