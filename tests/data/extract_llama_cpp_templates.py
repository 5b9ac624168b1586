"""Write llama_cpp_chat_templates.json from llama.cpp's tests/test-chat-template.cpp: each
test case's template, BOS and EOS text, and the output llama.cpp's Jinja path must give
for its fixed conversation (expected_output_jinja, else expected_output).

    python tests/data/extract_llama_cpp_templates.py VENDOR/llama.cpp/tests/test-chat-template.cpp
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "'": "'", "0": "\0"}
LITERAL = re.compile(r'\s*(?:u8)?"((?:[^"\\]|\\.)*)"', re.S)


def literals(text: str, at: int) -> tuple[str, int]:
    """Adjacent C++ string literals from `at` (inside U8C(...) or not), unescaped."""
    out = []
    while text[at].isspace():
        at += 1
    wrapped = text.startswith("U8C(", at)
    if wrapped:
        at += 4
    while match := LITERAL.match(text, at):
        out.append(re.sub(r"\\(.)", lambda m: ESCAPES[m.group(1)], match.group(1)))
        at = match.end()
    return "".join(out), at


def cases(source: str) -> list[dict[str, object]]:
    body = source[source.index("std::vector<TestCase> test_cases {") :]
    out = []
    for chunk in body.split("/* .name= */")[1:]:
        case: dict[str, object] = {"name": literals(chunk, 0)[0]}
        fields = ("template_str", "expected_output", "expected_output_jinja", "bos_token")
        for field in (*fields, "eos_token"):
            if marker := re.search(rf"/\* \.{field}=? \*/", chunk):  # the "=" is sometimes missing
                case[field] = literals(chunk, marker.end())[0]
        marker = "/* .supported_with_jinja= */"
        if marker in chunk:
            value = chunk[chunk.index(marker) + len(marker) :].lstrip()
            case["supported_with_jinja"] = value.startswith("true")
        marker = "/* .extra_conversation= */"
        if marker in chunk:
            start = chunk.index(marker) + len(marker)
            line = chunk[start : chunk.index("\n", start)]
            pairs, at = [], 0
            while (at := line.find('{"', at)) >= 0:
                role, at = literals(line, at + 1)
                at = line.index(",", at) + 1
                content, at = literals(line, at)
                pairs.append([role, content])
            case["extra_conversation"] = pairs
        out.append(case)
    return out


if __name__ == "__main__":
    found = cases(Path(sys.argv[1]).read_text(encoding="utf-8"))
    target = Path(__file__).with_name("llama_cpp_chat_templates.json")
    target.write_text(json.dumps(found, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{len(found)} cases written to {target}")
