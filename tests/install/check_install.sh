#!/usr/bin/env bash
# check_install.sh: `make install` as a user meets it. Installs what $BUILD
# holds into a scratch prefix ($BUILD/install-check/prefix), checks the
# layout (the soname and its links, the headers, cascade.pc), compiles every
# installed header on its own, then builds tests/install/example.c against
# the installed copy only, through pkg-config, twice: with the shared library
# (found through an rpath) and with the static one (pkg-config --static), and
# runs both. Then a staged install (DESTDIR) must land under DESTDIR alone,
# and `make uninstall` must leave both trees without a file.
#
# Run by `make test` (tests/run_all.sh) with BUILD, and under `make asan` with
# the sanitizer CFLAGS and LDFLAGS in the environment (make exports
# command-line variables): the example is compiled and linked with them, as a
# sanitized static library needs. Prints "ok"/"FAIL" lines and the summary
# "N passed, N failed". The example's model tests need
# models/SmolLM2-135M-Instruct.Q4_1.gguf (`make model`); without it they are
# skipped with a line saying so.
set -u
cd "$(dirname "$0")/../.."
root=$(pwd)
BUILD=${BUILD:-build}
CC=${CC:-cc}
CFLAGS=${CFLAGS:-}
LDFLAGS=${LDFLAGS:-}
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
SONAME=libcascade.so.0
HEADERS="attn.h core.h engine.h kv.h model.h sched.h tensor.h"
# a CUDA=1 library installs the GPU attention contract too
nm "$BUILD/libcascade.a" 2>/dev/null | grep -q ' T cas_cuda_attn_create$' &&
  HEADERS="attn.h core.h cuda_attn.h engine.h kv.h model.h sched.h tensor.h"

passed=0; failed=0
ok()   { echo "ok $1"; passed=$((passed+1)); }
fail() { echo "FAIL $1: $2"; failed=$((failed+1)); }
check() { local name=$1 why=$2; shift 2; if "$@"; then ok "$name"; else fail "$name" "$why"; fi; }
finish() { echo "$passed passed, $failed failed"; [ "$failed" -eq 0 ]; exit; }

case "$BUILD" in /*) ;; *) BUILD="$root/$BUILD" ;; esac
scratch="$BUILD/install-check"
prefix="$scratch/prefix"
rm -rf "$scratch" && mkdir -p "$scratch" || { fail setup "cannot create $scratch"; finish; }

# The make that runs us may have passed a jobserver we cannot use; drop it,
# keep its command-line variables (BUILD, OPT, CFLAGS, ... under make asan).
MAKEFLAGS=$(printf '%s' "${MAKEFLAGS:-}" | sed -E 's/(^| )(-j[0-9]*|--jobserver-(auth|fds)=[^ ]*)//g')
export MAKEFLAGS
mk() { make -s --no-print-directory BUILD="$BUILD" "$@"; }

# ---- install into the scratch prefix ----------------------------------------
if ! mk install PREFIX="$prefix" >"$scratch/install.log" 2>&1; then
  cat "$scratch/install.log"
  fail make_install "make install PREFIX=$prefix failed"
  finish
fi
ok make_install

lib="$prefix/lib"
version=$(PKG_CONFIG_PATH="$lib/pkgconfig" pkg-config --modversion cascade 2>/dev/null)
soname_of() { readelf -d "$1" 2>/dev/null | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p'; }
layout_ok() {
  [ -x "$prefix/bin/cascade" ] && [ -f "$lib/libcascade.a" ] &&
  [ -n "$version" ] && [ -f "$lib/libcascade.so.$version" ] && [ ! -L "$lib/libcascade.so.$version" ] &&
  [ "$(readlink "$lib/$SONAME")" = "libcascade.so.$version" ] &&
  [ "$(readlink "$lib/libcascade.so")" = "$SONAME" ] &&
  [ "$(soname_of "$lib/libcascade.so.$version")" = "$SONAME" ] &&
  [ "$(soname_of "$BUILD/libcascade.so")" = "$SONAME" ] &&
  [ "$(readlink "$BUILD/$SONAME")" = libcascade.so ] &&
  [ -f "$lib/pkgconfig/cascade.pc" ]
}
check layout "bin/cascade, lib/libcascade.{a,so.$version} with soname $SONAME and its links, cascade.pc" layout_ok
"$prefix/bin/cascade" >/dev/null 2>&1; rc=$?
check command_runs "the installed cascade crashed (exit $rc)" test "$rc" -lt 128

got=$(cd "$prefix/include/cascade" 2>/dev/null && echo *.h)
check headers "include/cascade holds '$got', want '$HEADERS'" test "$got" = "$HEADERS"
check header_includes "an installed header still includes a path out of include/cascade" \
  bash -c '! grep -n "#[[:space:]]*include[[:space:]]*\"[^\"]*/" "$1"/*.h' _ "$prefix/include/cascade"

export PKG_CONFIG_PATH="$lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
check pkg_config "pkg-config cannot read cascade.pc" pkg-config --exists cascade
check pkg_config_prefix "cascade.pc's libdir is not $lib" test "$(pkg-config --variable=libdir cascade)" = "$lib"
pc_cflags=$(pkg-config --cflags cascade)

# Each header alone, as the first include of a file, in strict C11.
hdr_fail=""
for h in $HEADERS; do
  printf '#include <cascade/%s>\n' "$h" |
    $CC -std=c11 -Wall -Wextra -Wpedantic -Werror -fsyntax-only $pc_cflags -x c - \
      >"$scratch/hdr-$h.log" 2>&1 || { hdr_fail="$hdr_fail $h"; head -n 5 "$scratch/hdr-$h.log"; }
done
check headers_compile "not self-contained:$hdr_fail" test -z "$hdr_fail"
# and from C++ (their extern "C" blocks), where a C++ compiler is present
CXX=${CXX:-c++}
if command -v "$CXX" >/dev/null 2>&1; then
  hdr_fail=""
  for h in $HEADERS; do
    printf '#include <cascade/%s>\n' "$h" |
      $CXX -std=c++17 -Wall -Wextra -Wpedantic -Werror -fsyntax-only $pc_cflags -x c++ - \
        >"$scratch/hdr-$h-cxx.log" 2>&1 || { hdr_fail="$hdr_fail $h"; head -n 5 "$scratch/hdr-$h-cxx.log"; }
  done
  check headers_compile_cxx "not usable from C++:$hdr_fail" test -z "$hdr_fail"
else
  echo "skip headers_compile_cxx: no C++ compiler ($CXX)"
fi

# ---- the example, shared and static -------------------------------------------
model_arg=""
if [ -f "$MODEL" ]; then
  model_arg="$root/$MODEL"; want=5
else
  echo "skip example's model tests: $MODEL missing (make model)"; want=3
fi

# run_example NAME BINARY: runs it, relays its lines tagged with NAME, and
# passes when it exits 0 having passed all `want` of its tests.
run_example() {
  local out rc line
  out=$(cd "$scratch" && "$2" ${model_arg:+"$model_arg"} 2>&1); rc=$?
  printf '%s\n' "$out" | sed -E "s/^(ok|FAIL|skip) /\1 [$1] /; s/^([0-9]+ passed)/[$1] \1/"
  line=$(printf '%s\n' "$out" | grep -E '^[0-9]+ passed, [0-9]+ failed' | tail -n1)
  check "example_$1" "exit $rc, summary '$line', want '$want passed, 0 failed'" \
    test "$rc" -eq 0 -a "$line" = "$want passed, 0 failed"
}
ex=tests/install/example.c
warn="-std=c11 -Wall -Wextra -Wpedantic -Werror"

# shared: plain pkg-config flags; the rpath stands in for ldconfig
libs=$(pkg-config --libs cascade)
if $CC $warn $CFLAGS -Itests -o "$scratch/example_shared" $ex $pc_cflags $libs \
     -Wl,-rpath,"$lib" $LDFLAGS >"$scratch/cc-shared.log" 2>&1; then
  ok build_shared
  check needs_soname "example_shared does not load $SONAME" \
    bash -c 'readelf -d "$1" | grep -q "(NEEDED).*\[$2\]"' _ "$scratch/example_shared" "$SONAME"
  run_example shared "$scratch/example_shared"
else
  cat "$scratch/cc-shared.log"; fail build_shared "$CC ... \$(pkg-config --cflags --libs cascade) failed"
fi

# static: --static adds Libs.private (what the archive needs); -l:libcascade.a
# makes the linker take the archive although the .so sits next to it
libs=$(pkg-config --libs --static cascade)
libs=${libs/-lcascade/-l:libcascade.a}
if $CC $warn $CFLAGS -Itests -o "$scratch/example_static" $ex $pc_cflags $libs \
     $LDFLAGS >"$scratch/cc-static.log" 2>&1; then
  ok build_static
  check static_no_so "example_static still loads libcascade.so" \
    bash -c '! readelf -d "$1" | grep -q "(NEEDED).*libcascade"' _ "$scratch/example_static"
  run_example static "$scratch/example_static"
else
  cat "$scratch/cc-static.log"; fail build_static "$CC ... \$(pkg-config --libs --static cascade) failed"
fi

# ---- DESTDIR and uninstall ------------------------------------------------------
fake=/nonexistent-cascade-prefix
stage="$scratch/stage"
if mk install DESTDIR="$stage" PREFIX="$fake" >"$scratch/destdir.log" 2>&1; then
  check destdir "a DESTDIR install put files outside $stage$fake or wrote the wrong prefix" \
    bash -c '[ -f "$1$2/lib/libcascade.a" ] && [ -f "$1$2/include/cascade/engine.h" ] &&
             grep -qx "prefix=$2" "$1$2/lib/pkgconfig/cascade.pc" && [ ! -e "$2" ] &&
             [ -z "$(find "$1" -mindepth 1 -maxdepth 1 ! -name "${2#/}")" ]' _ "$stage" "$fake"
else
  cat "$scratch/destdir.log"; fail destdir "make install DESTDIR=$stage failed"
fi
left() { find "$1" ! -type d | head -n 5; }
mk uninstall PREFIX="$prefix" >/dev/null 2>&1
check uninstall "left behind: $(left "$prefix")" test -z "$(left "$prefix")"
mk uninstall DESTDIR="$stage" PREFIX="$fake" >/dev/null 2>&1
check uninstall_destdir "left behind: $(left "$stage")" test -z "$(left "$stage")"

finish
