"""The command line registers only the subcommand it is given (cli.py), so that a restarted cache
daemon parses its flags without importing the inference server (issue 34 item 6); anything else
(``--help``, a typo) gets the whole parser, naming every subcommand."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from keepwarm_runtime.cli import SUBCOMMAND_MODULES, build_parser, main, named_subcommand


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["cache", "serve", "--socket-dir", "/x"], "cache"),
        (["--log-level", "DEBUG", "cache", "ls"], "cache"),
        (["--log-level=DEBUG", "serve", "/m"], "serve"),
        (["make-model", "/out"], "make-model"),
        (["bench", "handoff"], "bench"),
        (["--help"], None),
        (["-h"], None),
        (["cahce", "serve"], None),
        (["--log-level"], None),
        ([], None),
    ],
)
def test_the_named_subcommand_is_found_past_the_log_level(argv, named):
    assert named_subcommand(argv) == named


def test_the_whole_parser_names_every_subcommand_and_one_names_only_itself():
    def choices(parser):
        return set(parser._subparsers._group_actions[0].choices)

    assert choices(build_parser()) == set(SUBCOMMAND_MODULES)
    for name in SUBCOMMAND_MODULES:
        assert choices(build_parser(name)) == {name}


def test_a_mistyped_subcommand_is_answered_with_every_choice(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["cahce", "serve"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert all(repr(name) in err for name in SUBCOMMAND_MODULES)


def test_the_cache_daemon_start_path_imports_no_server_or_engine():
    """In a fresh interpreter, what `keepwarm cache serve` imports up to serving (parsing its flags,
    the node process, the daemon and the holder link) leaves the server and the engine unimported."""
    code = (
        "import json, sys\n"
        "import keepwarm_runtime.cli as cli\n"
        "argv = ['cache', 'serve', '--socket-dir', '/nonexistent', '--tier', 'host']\n"
        "cli.build_parser(cli.named_subcommand(argv)).parse_args(argv)\n"
        "import keepwarm_runtime.node, keepwarm_runtime.cache.daemon, keepwarm_runtime.cache.holder_link\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    modules = json.loads(out)
    assert "keepwarm_runtime.cache.daemon" in modules  # the check sees the start path's own modules
    heavy = [m for m in modules if m.startswith(("keepwarm_runtime.server", "keepwarm_runtime.engine"))]
    assert heavy == []
