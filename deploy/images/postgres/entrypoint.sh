#!/bin/sh
# The official postgres image's start: initialise $PGDATA on first start (the superuser
# POSTGRES_USER with POSTGRES_PASSWORD, the database POSTGRES_DB, password logins over TCP),
# then run the command (`postgres -c ...`) listening on every interface.
set -eu
: "${POSTGRES_USER:=postgres}"
: "${POSTGRES_DB:=$POSTGRES_USER}"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  password_file=$(mktemp)
  printf '%s\n' "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD must be set}" > "$password_file"
  initdb --username="$POSTGRES_USER" --pwfile="$password_file" --encoding=UTF8 --locale=C.UTF-8 \
    --auth-local=trust --auth-host=scram-sha-256 >/dev/null
  rm -f "$password_file"
  printf 'host all all all scram-sha-256\nhost replication all all scram-sha-256\n' \
    >> "$PGDATA/pg_hba.conf"
  if [ "$POSTGRES_DB" != postgres ]; then
    pg_ctl --wait --silent --options="-c listen_addresses=''" start
    createdb --username="$POSTGRES_USER" "$POSTGRES_DB"
    pg_ctl --wait --silent --mode=fast stop
  fi
fi
if [ "$1" = postgres ]; then
  shift
  exec postgres -c listen_addresses='*' "$@"
fi
exec "$@"
