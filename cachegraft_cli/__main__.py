from cachegraft_cli.cli.app import main

main()
