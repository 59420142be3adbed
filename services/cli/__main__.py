"""`python -m switchyard.services.cli`: the `switchyard` command."""

from switchyard.services.cli import main

if __name__ == "__main__":
    main()
