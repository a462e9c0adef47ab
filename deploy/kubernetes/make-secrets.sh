#!/bin/sh
# Replace the placeholder credentials of an overlay with real ones:
#
#   deploy/kubernetes/make-secrets.sh deploy/kubernetes/overlays/bundled-postgres
#   DB_URL='postgresql+psycopg://USER:PASSWORD@HOST:5432/tidal?sslmode=require' \
#       deploy/kubernetes/make-secrets.sh deploy/kubernetes/overlays/external-postgres
#
# Writes OVERLAY/secrets/{server.secret,admin.token,agent.token} (and for the
# bundled database db-password and db-url; for an external one db-url from
# $DB_URL), mode 0600, without trailing newlines (they become
# environment variables). The join token is derived from the new server
# secret with `tidal agent-token`, so `tidal` must be installed here.
# Never commit the result (docs/deploy.md).
set -eu

dir=${1:?usage: make-secrets.sh OVERLAY_DIR}
out="$dir/secrets"
[ -d "$out" ] || { echo "make-secrets.sh: $out is not a directory" >&2; exit 2; }
command -v openssl >/dev/null || { echo "make-secrets.sh: openssl not found" >&2; exit 2; }
command -v tidal >/dev/null || { echo "make-secrets.sh: tidal not found (pip install tidal)" >&2; exit 2; }

umask 077
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

openssl rand -hex 32 > "$work/server.secret"   # the server's HMAC secret, hex
printf '%s' "$(cat "$work/server.secret")" > "$out/server.secret"
printf '%s' "$(openssl rand -hex 24)" > "$out/admin.token"
printf '%s' "$(tidal agent-token --home "$work")" > "$out/agent.token"

if [ -f "$out/db-password" ]; then
    # the bundled PostgreSQL: its password, and the URL the server uses (hex:
    # nothing to escape in a URL)
    password=$(openssl rand -hex 24)
    printf '%s' "$password" > "$out/db-password"
    printf 'postgresql+psycopg://tidal:%s@tidal-postgres:5432/tidal' "$password" > "$out/db-url"
elif [ -n "${DB_URL:-}" ]; then
    printf '%s' "$DB_URL" > "$out/db-url"
else
    echo "make-secrets.sh: $out/db-url left as it is; set DB_URL to write it" >&2
fi
chmod 0600 "$out"/*   # files that existed kept their mode
echo "make-secrets.sh: wrote the credentials in $out (do not commit them)"
