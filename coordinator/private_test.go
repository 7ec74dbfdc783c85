package coordinator

import (
	"context"
	"database/sql"
	"net/http/httptest"
	"testing"
)

// TestPrivateJobPrivateFromItsFirstRow: a private job's row is written with its join token. It
// used to be created public and made private in a second transaction, and a coordinator taking
// queued jobs up in between ran it as a public job — its status shown to anyone
// (TestPrivateJobHidden failed so under load), and anyone admitted. A trigger records the
// token every inserted job row carries.
func TestPrivateJobPrivateFromItsFirstRow(t *testing.T) {
	srv, err := New(context.Background(), Config{DataDir: t.TempDir(), Loopback: true, AdminToken: servingAdmin, Logger: testLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	raw, err := sql.Open("sqlite", srv.db.Path())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { raw.Close() })
	if _, err := raw.Exec(`CREATE TABLE inserted (token TEXT NOT NULL);
		CREATE TRIGGER record_insert AFTER INSERT ON jobs BEGIN INSERT INTO inserted VALUES (NEW.join_token); END;`); err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv.Handler())
	t.Cleanup(hs.Close)
	sub := submitJob(t, hs.URL, tinyJob(t, 4), true)
	var tokens []string
	rows, err := raw.Query("SELECT token FROM inserted")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var s string
		rows.Scan(&s)
		tokens = append(tokens, s)
	}
	if len(tokens) != 1 || tokens[0] != sub.Token {
		t.Errorf("the private job's row was inserted with tokens %q; want its join token: created public, a coordinator taking it up at once runs it public", tokens)
	}
}
