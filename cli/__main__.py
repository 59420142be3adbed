"""`python -m switchyard.cli`: the `switchyard` command."""

from switchyard.cli import main

if __name__ == "__main__":
    main()
