"""README's "Try it", as a newcomer runs it: ``python .ci/readme.py try-it`` prints the
commands of its bash block (one a line; blank and comment lines left out) but the clone
(``git clone ...`` and ``cd``: CI runs in a clone already), ``python .ci/readme.py example``
the README's first Python example (to run as a script)."""

import os
import re
import sys

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def main(what: str) -> None:
    with open(README) as f:
        text = f.read()
    if what == "example":
        print(blocks(text, "python")[0])
    elif what == "try-it":
        section = text.split("## Try it", 1)[1]
        for line in blocks(section, "bash")[0].splitlines():
            command = line.split("#", 1)[0].strip()
            if command and not command.startswith("git clone "):
                print(command)
    else:
        raise SystemExit(f"usage: {sys.argv[0]} try-it|example")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
