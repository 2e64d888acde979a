"""bench/readme_commands.py: run the README's "Train your own model" block as a newcomer would
(`make test-readme`), one command after the other, and print each one's wall and CPU time.

It reads the block from README.md, so the commands it times are the ones the README shows; the
output folders they write (runs/*-smol) are removed first. Exits 1 if a command fails or takes
more than --limit seconds.

    python bench/readme_commands.py [--limit 600]
"""

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def commands():
    """The block's `python ...` lines, $M replaced by the model the block's first line names."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme[readme.index("## Train your own model"):]
    block = section[section.index("```bash") + 7:section.index("```", section.index("```bash") + 7)]
    model = re.search(r"M=(\S+)", block).group(1)
    return [re.sub(r"\s+#.*$", "", line).replace("$M", model).split() for line in block.splitlines() if line.startswith("python ")]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--limit", type=float, default=600, help="seconds a command may take")
    limit = p.parse_args().limit
    for argv in commands():  # the block's own output folders, so that a second run starts as the first did
        if "--output_dir" in argv:
            shutil.rmtree(os.path.join(ROOT, argv[argv.index("--output_dir") + 1]), ignore_errors=True)
    rows, failed = [], False
    for argv in commands():
        before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.time()
        proc = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True, text=True)
        after, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.time() - start
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        ok = proc.returncode == 0 and wall <= limit
        failed |= not ok
        rows.append((argv[1], wall, cpu, "ok" if ok else f"FAILED (exit {proc.returncode})"))
        print(f"{argv[1]:<9} {wall:6.0f} s wall {cpu:6.0f} s CPU  {rows[-1][3]}   {' '.join(argv)}", flush=True)
        if proc.returncode:
            print(proc.stdout[-2000:], proc.stderr[-3000:], sep="\n")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
