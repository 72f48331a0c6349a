"""A payments upstream in Python behind `idem serve`, completing each keyed run in its own
PostgreSQL transaction: the ledger row and the answer idem replays commit together, or neither does.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test IDEM_SCHEMA=idem PORT=3000 \
        python3 upstream.py

`idem serve --store 'postgres://…?schema=idem' --upstream http://127.0.0.1:3000 --in-transaction`
sends every keyed request with an `Idempotency-Token`; this service passes it to
`idem_complete(token, status, headers, body)`, which the idem store installed in its schema, in the
same transaction as its ledger row. If the token is no longer this run's (the gateway died and
another took the key over), `idem_complete` raises, the transaction rolls back, and the row never
appears. Needs psycopg 3: `pip install 'psycopg[binary]'`.
"""

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psycopg
from psycopg import sql

DATABASE_URL = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test")
# The schema of the idem store (its URL's `schema=`), where idem_complete is; empty: the search_path.
SCHEMA = os.environ.get("IDEM_SCHEMA", "")
PORT = int(os.environ.get("PORT", "3000"))


def qualified(name):
    return sql.SQL("{}.{}").format(sql.Identifier(SCHEMA), sql.Identifier(name)) if SCHEMA else sql.Identifier(name)


def set_up():
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE TABLE IF NOT EXISTS {} (id BIGSERIAL PRIMARY KEY, key TEXT, amount BIGINT NOT NULL)").format(
                qualified("python_ledger")
            )
        )


class Payments(BaseHTTPRequestHandler):
    def do_POST(self):
        if self.path != "/pay":
            return self.answer(404, {"error": "no such route"})
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
        key = (self.headers.get("Idempotency-Key") or "").strip('"') or None
        token = self.headers.get("Idempotency-Token")
        recovered = self.headers.get("Idempotency-Recovered") == "true"
        amount = int(body.get("amount", 0))
        with psycopg.connect(DATABASE_URL) as conn:
            try:
                with conn.transaction():
                    charge = conn.execute(
                        sql.SQL("INSERT INTO {} (key, amount) VALUES (%s, %s) RETURNING id").format(
                            qualified("python_ledger")
                        ),
                        (key, amount),
                    ).fetchone()[0]
                    answer = {"charge": charge, "amount": amount, "recovered": recovered}
                    encoded = json.dumps(answer).encode()
                    if token:
                        # The answer commits with the ledger row, or neither does.
                        conn.execute(
                            sql.SQL("SELECT {}(%s, %s, %s::jsonb, %s)").format(qualified("idem_complete")),
                            (token, 201, json.dumps({"Content-Type": "application/json"}), encoded),
                        )
            except psycopg.Error as err:
                if err.sqlstate == "IDEM1":
                    # Another run holds the key now and answers the client; nothing was committed.
                    return self.answer(409, {"error": "taken over by another run"})
                raise
        self.answer(201, answer)

    def answer(self, status, payload):
        encoded = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(encoded)))
        self.end_headers()
        self.wfile.write(encoded)

    def log_message(self, format, *args):
        sys.stderr.write("python upstream: " + (format % args) + "\n")


if __name__ == "__main__":
    set_up()
    server = ThreadingHTTPServer(("127.0.0.1", PORT), Payments)
    print(f"python upstream listening on http://127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever()
