#!/bin/sh
# PostgreSQL for the demo: a fresh cluster in $PGDATA on first start,
# trusting every client on the compose network (a demo, not a deployment).
set -e
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  initdb -D "$PGDATA" -U postgres -A trust --locale=C -E UTF8 >/dev/null
  echo "host all all 0.0.0.0/0 trust" >>"$PGDATA/pg_hba.conf"
fi
exec postgres -D "$PGDATA" -c listen_addresses='*' -k /tmp
