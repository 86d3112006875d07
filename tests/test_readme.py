"""The README says what the code does: every message its Troubleshooting quotes is one the code prints."""

import ast
import re

from helpers import REPO


def printed():
    """Every string literal of the stages, common/ and tools/, f-string fields replaced by a NUL: what the
    code can print, with what varies cut out (adjacent literals are joined by the parser)."""
    texts = []
    for path in [*REPO.glob("0*/train.py"), *REPO.glob("common/*.py"), *REPO.glob("tools/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                texts.append("".join(v.value if isinstance(v, ast.Constant) else "\0" for v in node.values))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                texts.append(node.value)
    return texts


def test_every_troubleshooting_heading_is_a_line_the_code_prints():
    section = (REPO / "README.md").read_text().split("## Troubleshooting\n")[1].split("\n## ")[0]
    quoted = re.findall(r"^- \*\*`([^`]+)`", section, re.M)
    assert len(quoted) >= 5
    texts = printed()
    for message in quoted:
        assert any(message in text for text in texts), message
    assert not any("Address already in use" in text for text in texts)  # torch's words, which the run replaces
