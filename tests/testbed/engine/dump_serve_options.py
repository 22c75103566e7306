"""Print, as JSON, every option `vllm serve` accepts in the installed vLLM, from its real argument parser.

Runs inside the engine image (tests/testbed/vllm-options.sh). The parser is built exactly as
`vllm serve` builds it in 0.32.0 (vllm/entrypoints/cli/serve.py: ``make_arg_parser`` from
``vllm.entrypoints.launchers.cli_args`` applied to a FlexibleArgumentParser), then its actions are walked.

Output (stdout), a JSON object:
  vllm_version  str   version of the installed vllm package
  parser        str   dotted path of the parser factory
  positionals   list  positional argument names (``model_tag``)
  options       list  one entry per option string, sorted by it:
      option       str        e.g. "--max-model-len" (aliases such as "-tp" get their own entry)
      dest         str        argparse destination shared by all aliases of one option
      takes_value  bool       false for flags (store_true/store_false, --x/--no-x pairs, --help)
      nargs        str|int|null  argparse nargs ("?", "+", "*", an int, or null for exactly one)
      choices      list|null  allowed values as strings, when the option restricts them
Errors: ImportError when vLLM is not installed; ValueError if the parser has an unexpected shape
(no options found).
"""

from __future__ import annotations

import argparse
import json
import sys

PARSER_FACTORY = "vllm.entrypoints.launchers.cli_args.make_arg_parser"


def describe(parser: argparse.ArgumentParser) -> tuple[list[str], list[dict]]:
    """Walk ``parser``'s actions; return (positional dest names, option entries as documented above)."""
    positionals, options = [], []
    for action in parser._actions:  # argparse exposes no public iterator over its actions
        if not action.option_strings:
            positionals.append(action.dest)
            continue
        choices = None if action.choices is None else sorted(str(c) for c in action.choices)
        for opt in action.option_strings:
            options.append({
                "option": opt,
                "dest": action.dest,
                "takes_value": action.nargs != 0,
                "nargs": action.nargs,
                "choices": choices,
            })
    if not options:
        raise ValueError("the serve parser exposes no options; has its construction changed?")
    options.sort(key=lambda o: str(o["option"]))
    return positionals, options


def main() -> None:
    from importlib.metadata import version

    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    positionals, options = describe(parser)
    json.dump({"vllm_version": version("vllm"), "parser": PARSER_FACTORY,
               "positionals": positionals, "options": options}, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
