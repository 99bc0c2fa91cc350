from specpipe.cli import main

main()
