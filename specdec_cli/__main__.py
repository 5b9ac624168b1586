"""The `specdec` command and `python -m specdec_cli`.

Ctrl-C is taken over before anything heavy is imported: importing llama.cpp and
numpy takes a while, and a Ctrl-C then must not end in a traceback.
"""

from specdec_cli import interrupt


def main() -> None:
    interrupt.install()
    # llama.cpp's libraries before numpy: with numpy 2.5 loaded first, a CUDA build of
    # llama.cpp crashed in its first model load, printing the model's facts (an H100;
    # benchmarks/README.md, "On a GPU: Gemma 3 270M").
    import llama_cpp.llama_cpp  # noqa: F401

    from specdec_cli.commands.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
