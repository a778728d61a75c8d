from mist.cli import main

main()
