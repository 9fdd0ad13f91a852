"""`lorafusion VERB -h`: every argument has help text with its default (required ones have none), every verb a
description and an example at the end."""

import argparse

import pytest

from lorafusion.cli.parser import build_parser

PARSER = build_parser()


@pytest.mark.parametrize("verb", sorted(PARSER.subcommands))
def test_every_argument_is_explained_with_its_default_and_the_help_ends_with_an_example(verb):
    sub = PARSER.subcommands[verb]
    assert sub.description and sub.description.endswith(".")
    text = sub.format_help()
    assert text.rstrip().splitlines()[-1].strip().startswith(f"lorafusion {verb} "), text
    assert "\nexample:\n" in text
    for action in sub._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, (verb, action.dest)
        shown = sub._get_formatter()._expand_help(action) if action.help else ""
        optional_with_default = action.option_strings and not action.required
        assert not optional_with_default or "default" in shown, (verb, action.dest, shown)


def test_cancel_job_and_the_run_config_are_described():
    cancel = {a.dest: a.help for a in PARSER.subcommands["cancel"]._actions}
    assert "name of the job" in cancel["job"]
    for verb in ("train", "plan"):
        assert "run YAML" in {a.dest: a.help for a in PARSER.subcommands[verb]._actions}["config"]
