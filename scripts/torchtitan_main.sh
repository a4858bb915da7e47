#!/usr/bin/env bash
# TorchTitan main snapshot: extracts the pinned commit of TorchTitan main into a folder, for
# tests/test_torchtitan.py::test_torchtitan_main_at_the_pinned_commit, and prints the line that
# points the test at it (stdout: only that line; progress goes to stderr).
#
#   eval "$(scripts/torchtitan_main.sh [--git-dir DIR] [--commit SHA] [DEST])"
#   pytest -q tests/test_torchtitan.py
#
# --git-dir: a clone or bare mirror of pytorch/torchtitan holding the commit (default:
#   $TORCHTITAN_GIT_DIR, else the commit alone is fetched from GitHub into a scratch repository).
# --commit: default, the first word of tests/torchtitan_main_commit.txt (the pin the test expects).
# DEST: default ${TMPDIR:-/tmp}/torchtitan-main-<first 12 hex digits of the commit>; a snapshot
#   already there is replaced (any other existing folder is refused).
#
# Only what importing TorchTitan needs is extracted (torchtitan/, and pyproject.toml, LICENSE,
# README.md, assets/version.txt for `pip install --no-deps DEST`), so a mirror lacking large test
# assets still works. The test puts DEST first on PYTHONPATH; it installs nothing.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
URL=https://github.com/pytorch/torchtitan.git
GIT_DIR_ARG=${TORCHTITAN_GIT_DIR:-}
COMMIT=$(awk 'NR == 1 {print $1}' "$ROOT/tests/torchtitan_main_commit.txt")
DEST=
while [ $# -gt 0 ]; do
  case $1 in
    --git-dir) GIT_DIR_ARG=$2; shift 2 ;;
    --commit) COMMIT=$2; shift 2 ;;
    -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
    *) DEST=$1; shift ;;
  esac
done
DEST=${DEST:-${TMPDIR:-/tmp}/torchtitan-main-${COMMIT:0:12}}

SCRATCH=
trap '[ -z "$SCRATCH" ] || rm -rf "$SCRATCH"' EXIT
if [ -z "$GIT_DIR_ARG" ]; then
  # No local copy: fetch the one commit (GitHub serves any reachable commit by its hash).
  SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/torchtitan-git-XXXXXX")
  echo "fetching $COMMIT from $URL" >&2
  git init -q --bare "$SCRATCH/repo.git"
  git --git-dir="$SCRATCH/repo.git" fetch -q --depth 1 "$URL" "$COMMIT" >&2
  GIT_DIR_ARG=$SCRATCH/repo.git
fi
G=(git --git-dir="$GIT_DIR_ARG")
FULL=$("${G[@]}" rev-parse --verify "$COMMIT^{commit}") || { echo "$GIT_DIR_ARG has no commit $COMMIT" >&2; exit 1; }

if [ -e "$DEST" ]; then
  # Replace only a folder this script made: DEST may be mistyped.
  [ -f "$DEST/TORCHTITAN_COMMIT" ] || { echo "$DEST exists and is not a snapshot made by $0; not replacing it" >&2; exit 1; }
  rm -rf "$DEST"
fi
mkdir -p "$DEST/assets"
# The torchtitan tree on its own: archiving the whole commit would read every blob, and a mirror
# may lack large test assets.
"${G[@]}" archive --format=tar --prefix=torchtitan/ "$FULL:torchtitan" | tar -x -C "$DEST"
for f in pyproject.toml LICENSE README.md assets/version.txt; do
  "${G[@]}" show "$FULL:$f" > "$DEST/$f" 2>/dev/null || rm -f "$DEST/$f"
done
echo "$FULL" > "$DEST/TORCHTITAN_COMMIT"
echo "TorchTitan $("${G[@]}" log -1 --format='%h %cs %s' "$FULL") extracted to $DEST" >&2
printf 'export DCPDS_TORCHTITAN_MAIN=%q\n' "$DEST"
