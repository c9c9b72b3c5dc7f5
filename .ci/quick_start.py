"""Print the README's quick-start commands, one a line: the first ```bash block under the
"Install and quick start" heading. .ci/run runs exactly these."""
import re
import sys

text = open(sys.argv[1], encoding="utf-8").read()
section = text.split("## Install and quick start", 1)[1]
block = re.search(r"```bash\n(.*?)```", section, re.S)[1]
print("\n".join(line for line in block.splitlines() if line.strip()))
