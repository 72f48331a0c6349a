#!/usr/bin/env bash
# Builds idem's OCI image from this repository by one command: the release binary (or one given),
# the shared libraries `ldd` says it loads, CA certificates and a non-root user, FROM scratch, so
# no image registry is needed. The recipe is deploy/image/Containerfile; see deploy/image/README.md.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: bash deploy/image/build.sh [OPTIONS]

Builds an OCI image of idem FROM scratch: /usr/local/bin/idem, exactly the shared libraries it
loads (from ldd, the dynamic loader at its path), CA certificates, user 65532 `idem`, a writable
/var/lib/idem (the working directory) and /tmp. No image registry is needed.

Without --binary, first runs `cargo build --release --locked -p idem --bin idem`.

Options:
  --tag NAME             Tag the image NAME (repeat for more tags). Default:
                         localhost/idem:VERSION and localhost/idem:latest, VERSION from Cargo.toml.
  --binary PATH          Pack this idem binary instead of building one. It must print
                         `idem VERSION` for --version, VERSION being the workspace's.
  --engine TOOL          podman, buildah or docker. Default: the first of them on PATH.
  --ca-certificates FILE The PEM bundle put at /etc/ssl/certs/ca-certificates.crt.
                         Default: /etc/ssl/certs/ca-certificates.crt (Debian's ca-certificates).
  -h, --help             Show this help.

Environment:
  SOURCE_DATE_EPOCH      The image's creation time (seconds since the epoch), also the time of
                         every file in it. Default: the time of the checkout's last commit, so
                         that the same binary gives the same image (podman and buildah).

Labels: org.opencontainers.image.{title,version,source,revision,licenses,description,created};
revision is the checkout's commit, with `-dirty` if tracked files differ from it.
EOF
}

fail() {
  echo "build.sh: $*" >&2
  exit 1
}

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)

tags=()
binary=
engine=
ca_bundle=/etc/ssl/certs/ca-certificates.crt
while [ $# -gt 0 ]; do
  case "$1" in
    --tag) [ $# -ge 2 ] || fail "--tag needs a NAME"; tags+=("$2"); shift 2 ;;
    --tag=*) tags+=("${1#--tag=}"); shift ;;
    --binary) [ $# -ge 2 ] || fail "--binary needs a PATH"; binary=$2; shift 2 ;;
    --binary=*) binary=${1#--binary=}; shift ;;
    --engine) [ $# -ge 2 ] || fail "--engine needs podman, buildah or docker"; engine=$2; shift 2 ;;
    --engine=*) engine=${1#--engine=}; shift ;;
    --ca-certificates) [ $# -ge 2 ] || fail "--ca-certificates needs a FILE"; ca_bundle=$2; shift 2 ;;
    --ca-certificates=*) ca_bundle=${1#--ca-certificates=}; shift ;;
    -h | --help) usage; exit 0 ;;
    *) usage >&2; fail "unknown argument: $1" ;;
  esac
done

if [ -z "$engine" ]; then
  for candidate in podman buildah docker; do
    if command -v "$candidate" >/dev/null; then engine=$candidate; break; fi
  done
  [ -n "$engine" ] || fail "no podman, buildah or docker on PATH (Debian: apt-get install podman)"
fi
case "$engine" in
  podman | buildah | docker) command -v "$engine" >/dev/null || fail "$engine is not on PATH" ;;
  *) fail "--engine must be podman, buildah or docker, not $engine" ;;
esac
command -v ldd >/dev/null || fail "ldd is not on PATH (it comes with glibc: libc-bin on Debian)"

# The workspace's metadata, read from the manifests (no cargo needed with --binary).
# `table_value FILE TABLE KEY`: the string KEY = "…" in [TABLE] of FILE.
table_value() {
  sed -n "/^\[$2\]/,/^\[/p" "$1" | sed -n "s/^$3 *= *\"\(.*\)\"\$/\1/p" | head -n 1
}
version=$(table_value "$repo/Cargo.toml" workspace.package version)
licenses=$(table_value "$repo/Cargo.toml" workspace.package license)
source_url=$(table_value "$repo/Cargo.toml" workspace.package repository)
description=$(table_value "$repo/crates/idem/Cargo.toml" package description)
[ -n "$version" ] && [ -n "$licenses" ] && [ -n "$source_url" ] && [ -n "$description" ] \
  || fail "cannot read version, license, repository and description from Cargo.toml"
for tag in ${tags[@]+"${tags[@]}"}; do
  [ -n "$tag" ] || fail "--tag needs a NAME, not an empty one"
done
[ ${#tags[@]} -gt 0 ] || tags=("localhost/idem:$version" "localhost/idem:latest")

if git -C "$repo" rev-parse --git-dir >/dev/null 2>&1; then
  revision=$(git -C "$repo" rev-parse HEAD)
  if [ -n "$(git -C "$repo" status --porcelain --untracked-files=no)" ]; then
    revision="$revision-dirty"
  fi
  epoch=${SOURCE_DATE_EPOCH:-$(git -C "$repo" log -1 --format=%ct)}
else
  revision=unknown
  epoch=${SOURCE_DATE_EPOCH:-$(date +%s)}
fi
case "$epoch" in '' | *[!0-9]*) fail "SOURCE_DATE_EPOCH must be seconds since the epoch, not $epoch" ;; esac
created=$(date -u -d "@$epoch" +%Y-%m-%dT%H:%M:%SZ)

if [ -z "$binary" ]; then
  echo "build.sh: cargo build --release --locked -p idem --bin idem" >&2
  # The executable's path as cargo reports it (wherever the target directory is).
  binary=$(cd "$repo" && cargo build --release --locked -p idem --bin idem \
    --message-format=json-render-diagnostics \
    | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1)
  [ -n "$binary" ] || fail "cargo build did not report the idem executable"
fi
[ -f "$binary" ] && [ -x "$binary" ] || fail "$binary is not an executable file"
reported=$("$binary" --version) || fail "$binary --version failed"
[ "$reported" = "idem $version" ] \
  || fail "$binary says \`$reported\`; the workspace is idem $version (Cargo.toml)"
[ -f "$ca_bundle" ] || fail "no CA bundle at $ca_bundle (Debian: apt-get install ca-certificates)"

umask 022
context=$(mktemp -d "${TMPDIR:-/tmp}/idem-image.XXXXXX")
trap 'rm -rf "$context"' EXIT
rootfs=$context/rootfs

install -D -m 0755 "$binary" "$rootfs/usr/local/bin/idem"
# Every library at the path ldd resolved it to, and the loader at the path the binary asks for
# (`/lib64/ld-linux-x86-64.so.2 (0x…)`): the content, not the host's symlinks.
libraries=$(ldd "$binary" 2>&1) || true
if grep -q "not found" <<<"$libraries"; then
  fail "$binary needs libraries this machine lacks:"$'\n'"$libraries"
fi
while read -r first arrow path _; do
  if [ "$arrow" = "=>" ]; then
    library=$path
  else
    library=$first
  fi
  case "$library" in
    /*) install -D -m 0755 "$library" "$rootfs$library" ;;
    *) ;; # linux-vdso.so.1: the kernel's, in no file; or a static binary: nothing to copy
  esac
done <<<"$libraries"

install -D -m 0644 "$ca_bundle" "$rootfs/etc/ssl/certs/ca-certificates.crt"
printf 'idem:x:65532:65532:idem:/var/lib/idem:/sbin/nologin\n' >"$context/passwd"
printf 'idem:x:65532:\n' >"$context/group"
# glibc without this file asks DNS before /etc/hosts (`localhost`, Kubernetes' hostAliases).
printf 'hosts: files dns\n' >"$context/nsswitch.conf"
install -m 0644 "$context/passwd" "$context/group" "$context/nsswitch.conf" "$rootfs/etc/"
rm "$context/passwd" "$context/group" "$context/nsswitch.conf"
install -d -m 1777 "$rootfs/tmp"
# /var/lib is root's: the recipe's COPY --chown would otherwise create it as the user's.
install -d -m 0755 "$rootfs/var/lib"
install -d -m 0700 "$context/state/idem"
# The same time on every file, for engines that keep the context's (docker).
find "$context" -exec touch -h -d "@$epoch" {} +

build_args=(
  --build-arg "VERSION=$version"
  --build-arg "REVISION=$revision"
  --build-arg "CREATED=$created"
  --build-arg "SOURCE=$source_url"
  --build-arg "LICENSES=$licenses"
  --build-arg "DESCRIPTION=$description"
  --file "$here/Containerfile"
  --iidfile "$context/image-id"
)
for tag in "${tags[@]}"; do build_args+=(--tag "$tag"); done
case "$engine" in
  # One layer, no cached intermediate images, no builder's label, every time set to $epoch.
  podman | buildah)
    "$engine" build --format oci --layers=false --identity-label=false --timestamp "$epoch" \
      "${build_args[@]}" "$context" >&2 ;;
  docker)
    docker build --build-arg "SOURCE_DATE_EPOCH=$epoch" "${build_args[@]}" "$context" >&2 ;;
esac

image=$(cat "$context/image-id")
echo "build.sh: built $image (idem $version, $revision) as ${tags[*]}" >&2
echo "$image"
