"""The `specdec` command and `python -m specdec_cli`.

Ctrl-C is taken over before anything heavy is imported: importing llama.cpp and
numpy takes a while, and a Ctrl-C then must not end in a traceback.
"""

from specdec_cli.commands import interrupt


def main() -> None:
    interrupt.install()
    from specdec_cli.commands.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
