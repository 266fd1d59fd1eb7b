"""The operator's `--lora-modules-file` text (keepwarm_api.serveflags) read back by the runtime's parser,
and the contents it refuses by name."""

from __future__ import annotations

import pytest

from keepwarm_api.serveflags import lora_modules_file
from keepwarm_runtime.server.base.lora_modules import LoraModule, parse_lora_modules_file


def test_what_the_operator_writes_the_runtime_reads_back_in_order():
    text = lora_modules_file({"sql": "/lora/sql", "chat": "/host-models/adapters/chat"})
    assert parse_lora_modules_file(text, "f") == (
        LoraModule("sql", "/lora/sql"),
        LoraModule("chat", "/host-models/adapters/chat"),
    )
    assert parse_lora_modules_file(lora_modules_file({}), "f") == ()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "f is not valid JSON"),
        ('{"name": "a", "path": "/a"}', "f: expected a JSON list"),
        ('[{"name": "a"}]', "f entry 0: JSON form needs string name and path"),
        ('[{"name": "", "path": "/a"}]', "f entry 0: JSON form needs"),
        ('[{"name": "a", "path": "/a", "rank": 8}]', "f entry 0: JSON form needs"),
        ('[{"name": "a", "path": "/a", "base_model_name": 3}]', "f entry 0: JSON form needs"),
        ('[{"name": "a", "path": "/a"}, "b=/b"]', "f entry 1: JSON form needs"),
        ('[{"name": "a", "path": "/a"}, {"name": "a", "path": "/b"}]', "f: adapter 'a' is listed twice"),
    ],
)
def test_bad_contents_are_refused_naming_the_file_and_entry(text: str, message: str):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")):
        parse_lora_modules_file(text, "f")
