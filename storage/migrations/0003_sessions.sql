-- Worker session credentials: the sha256 of the credential of each worker's latest Welcome. A
-- worker rejoins under its id only with that credential (the coordinator keeps just the hash, so a
-- copy of the database does not let anyone impersonate a worker).
CREATE TABLE sessions (
	worker_id    TEXT PRIMARY KEY,
	token_sha256 BLOB NOT NULL,
	issued_at    TEXT NOT NULL
) STRICT;
