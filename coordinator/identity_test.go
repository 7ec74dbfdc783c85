package coordinator

import (
	"context"
	"crypto/ed25519"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/coder/websocket"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/storage"
)

// claimKey joins url with a hello that claims key and answers the identity challenge with
// sign's signature: the attacker who has another volunteer's public key but not its private
// half. It returns the coordinator's final answer.
func claimKey(t *testing.T, url, id string, key ed25519.PublicKey, sign func(msg []byte) []byte) proto.Message {
	t.Helper()
	ws := rawDial(t, url)
	defer ws.CloseNow()
	h := testHello("attacker")
	h.WorkerID, h.SigningKey = id, key
	b, err := proto.EncodeMessage(&h)
	if err != nil {
		t.Fatal(err)
	}
	rawWrite(t, ws, websocket.MessageText, b)
	ch, ok := rawRead(t, ws).(*proto.Challenge)
	if !ok {
		t.Fatalf("a hello claiming a key was not challenged")
	}
	b, err = proto.EncodeMessage(&proto.Proof{Signature: sign(proto.ProofMessage(ch.Nonce, key))})
	if err != nil {
		t.Fatal(err)
	}
	rawWrite(t, ws, websocket.MessageText, b)
	return rawRead(t, ws)
}

// TestIdentityClaimWithoutKeyRefused: while a volunteer trains (its key persisted, its credit
// verified by audits), an attacker joins claiming the volunteer's public key: it signs the
// challenge with a key of its own, or sends a signature of zeros. Each is refused before its
// Welcome with Error{identity}, and leaves nothing behind: no worker row, no event, no line on
// the leaderboard, and the volunteer's credit is one line, all its own.
func TestIdentityClaimWithoutKeyRefused(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a cluster run")
	}
	spec := tinyJob(t, 8)
	spec.AuditRate = 0.5
	victimPub, victimKey, _ := ed25519.GenerateKey(nil)
	_, ownKey, _ := ed25519.GenerateKey(nil)
	clusterConfig = func(cfg *Config) { cfg.Recompute = recomputeHere }
	defer func() { clusterConfig = nil }()
	c := startCluster(t, spec, 1, false, func(i int, cfg *client.WorkerConfig) {
		cfg.WorkerID, cfg.Identity = "victim", victimKey
	})
	url := "ws" + c.http.URL[len("http"):] + "/ws"
	var once sync.Once
	var answers []proto.Message
	c.onStep = func(r local.Report) {
		if r.Step != 3 {
			return
		}
		once.Do(func() {
			answers = append(answers,
				claimKey(t, url, "attacker-1", victimPub, func(m []byte) []byte { return ed25519.Sign(ownKey, m) }),
				claimKey(t, url, "attacker-2", victimPub, func([]byte) []byte { return make([]byte, ed25519.SignatureSize) }))
		})
	}
	c.run(t)
	if len(answers) != 2 {
		t.Fatalf("the attacks did not run: %v", answers)
	}
	for i, m := range answers {
		if e, ok := m.(*proto.Error); !ok || e.Code != proto.ErrCodeIdentity {
			t.Errorf("attacker %d got %#v, want Error{identity}", i+1, m)
		}
	}
	ctx := context.Background()
	for _, id := range []string{"attacker-1", "attacker-2"} {
		if _, err := c.srv.db.Worker(ctx, id); !errors.Is(err, storage.ErrNotFound) {
			t.Errorf("worker row of %s: %v, want none", id, err)
		}
		if evs, _ := c.srv.db.ListEvents(ctx, storage.EventFilter{WorkerID: id}); len(evs) > 0 {
			t.Errorf("events of %s: %+v", id, evs)
		}
	}
	credits, err := c.srv.db.Credits(ctx, c.srv.status.Load().jobID(t))
	if err != nil {
		t.Fatal(err)
	}
	if len(credits) != 1 || credits[0].Identity != proto.Fingerprint(victimPub) || credits[0].Worker != "victim" ||
		credits[0].VerifiedMicroBatches == 0 || credits[0].RejectedMicroBatches != 0 {
		t.Fatalf("credits %+v, want the volunteer's verified work alone, under its identity", credits)
	}
}

// joinAs dials url as a worker asking for id with key, and returns the coordinator's refusal
// (nil when it welcomed the worker, which then leaves at once).
func joinAs(t *testing.T, url, id string, key ed25519.PrivateKey) *proto.Error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	h := testHello(id)
	h.WorkerID, h.SigningKey = id, key.Public().(ed25519.PublicKey)
	conn, _, err := client.Dial(ctx, client.ConnConfig{URL: url, Hello: h, Key: key})
	if err == nil {
		conn.Close()
		return nil
	}
	var pe *proto.Error
	if !errors.As(err, &pe) {
		t.Fatalf("join as %s: %v, want a refusal or a welcome", id, err)
	}
	return pe
}

// TestBanCoversIdentityAndAddress: a worker caught cheating by an audit is banned, and with it
// its identity and, for Config.BanAddressFor, its address. Coming back under a fresh worker id
// with the same key is refused (Error{banned}), and so is a fresh id with a fresh key from the
// same address — the sybil who throws both away. The honest workers already there, from the same
// address, keep working: the job completes.
func TestBanCoversIdentityAndAddress(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a cluster run")
	}
	spec := tinyJob(t, 12)
	spec.Plan = auditPlan
	spec.AuditRate = 0.5
	_, cheatKey, _ := ed25519.GenerateKey(nil)
	_, freshKey, _ := ed25519.GenerateKey(nil)
	var url string
	var mu sync.Mutex
	var refusals []*proto.Error
	var bannedWho []string
	clusterConfig = func(cfg *Config) {
		cfg.Recompute = recomputeHere
		cfg.BanAddressFor = time.Hour
		cfg.OnEvent = func(kind, worker, detail string) {
			if kind != "peer.banned" {
				return
			}
			mu.Lock()
			defer mu.Unlock()
			bannedWho = append(bannedWho, worker)
			if len(bannedWho) == 1 {
				refusals = append(refusals, joinAs(t, url, "same-key", cheatKey), joinAs(t, url, "fresh-key", freshKey))
			}
		}
	}
	defer func() { clusterConfig = nil }()
	c := startCluster(t, spec, 4, false, func(i int, cfg *client.WorkerConfig) {
		cfg.WorkerID = fmt.Sprintf("w%d", i)
		if i == 1 {
			cfg.Fault, cfg.Identity = "flip-bit", cheatKey
		}
	})
	url = "ws" + c.http.URL[len("http"):] + "/ws"
	c.run(t)
	mu.Lock()
	defer mu.Unlock()
	if len(bannedWho) != 1 || bannedWho[0] != "w1" {
		t.Fatalf("banned %v, want [w1]", bannedWho)
	}
	for i, want := range []string{"identity", "address"} {
		if refusals[i] == nil || refusals[i].Code != proto.ErrCodeBanned || !strings.Contains(refusals[i].Message, want) {
			t.Errorf("a returning cheater with the same %s got %v, want Error{banned} naming its %s", want, refusals[i], want)
		}
	}
	ban, err := c.srv.db.WorkerBan(context.Background(), c.srv.status.Load().jobID(t), "w1")
	if err != nil || ban.Identity != proto.Fingerprint(cheatKey.Public().(ed25519.PublicKey)) || ban.Addr != "127.0.0.1" {
		t.Errorf("stored ban %+v, %v: want w1's identity and address", ban, err)
	}
}

// TestHubJoinRate: a flood of joins from one address is cut to its bucket: the joins past the
// burst are refused with Error{busy} before their hello is read, and leave no event behind;
// another address is not held back by it.
func TestHubJoinRate(t *testing.T) {
	checkHubLeaks(t)
	h, url := startHub(t, HubConfig{JoinRate: 1e-6, JoinBurst: 3})
	for i := 0; i < 3; i++ {
		c, _ := dialWorker(t, url, testHello(fmt.Sprint(i)), nil)
		expectEvent(t, h, EventJoined, c.ID())
	}
	for i := 0; i < 20; i++ {
		ws := rawDial(t, url)
		if m, ok := rawRead(t, ws).(*proto.Error); !ok || m.Code != proto.ErrCodeBusy || !strings.Contains(m.Message, "too many joins from this address") {
			t.Fatalf("join %d past the burst got %#v, want Error{busy}", i, m)
		}
		rawExpectClosed(t, ws)
	}
	select {
	case e := <-h.Events():
		t.Fatalf("event for a refused join: %+v", e)
	case <-time.After(50 * time.Millisecond):
	}
	if _, ok := h.allowJoin("192.0.2.1"); !ok {
		t.Error("another address is refused with this one")
	}
	if _, ok := h.allowJoin("127.0.0.1"); ok {
		t.Error("the flooding address is let in")
	}
}

// TestPruneUnusedWorkers: while a worker trains, a wave of others joins and leaves without ever
// taking part in a step. Once they are gone for the retention, their worker rows, events and
// session credentials are deleted; the row of the worker that trained stays, however old.
func TestPruneUnusedWorkers(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a cluster run")
	}
	spec := tinyJob(t, 6)
	c := startCluster(t, spec, 1, false, func(i int, cfg *client.WorkerConfig) { cfg.WorkerID = "worker" })
	url := "ws" + c.http.URL[len("http"):] + "/ws"
	var once sync.Once
	var wave []string
	c.onStep = func(r local.Report) {
		if r.Step != 2 {
			return
		}
		once.Do(func() {
			for i := 0; i < 5; i++ {
				ctx, cancel := context.WithTimeout(context.Background(), waitFor)
				conn, w, err := client.Dial(ctx, client.ConnConfig{URL: url, Hello: testHello("wave")})
				cancel()
				if err != nil {
					t.Errorf("join: %v", err)
					return
				}
				wave = append(wave, w.WorkerID)
				conn.Leave("never used")
			}
		})
	}
	c.run(t)
	ctx := context.Background()
	if len(wave) != 5 {
		t.Fatalf("the wave did not join: %v", wave)
	}
	for _, id := range append([]string{"worker"}, wave...) {
		if _, err := c.srv.db.Worker(ctx, id); err != nil {
			t.Fatalf("worker %s: %v, want a row before the retention", id, err)
		}
	}
	n, err := c.srv.db.PruneWorkers(ctx, time.Now().Add(time.Hour)) // as if a day had passed
	if err != nil {
		t.Fatal(err)
	}
	if n != int64(len(wave)) {
		t.Errorf("pruned %d workers, want the wave's %d", n, len(wave))
	}
	for _, id := range wave {
		if _, err := c.srv.db.Worker(ctx, id); !errors.Is(err, storage.ErrNotFound) {
			t.Errorf("worker row of %s after the retention: %v", id, err)
		}
		if evs, _ := c.srv.db.ListEvents(ctx, storage.EventFilter{WorkerID: id}); len(evs) > 0 {
			t.Errorf("events of %s after the retention: %d", id, len(evs))
		}
		if known, _ := c.srv.db.KnownWorker(ctx, id); known {
			t.Errorf("%s still known (a session or a row) after the retention", id)
		}
	}
	if _, err := c.srv.db.Worker(ctx, "worker"); err != nil {
		t.Errorf("the worker that trained lost its row: %v", err)
	}
	if evs, _ := c.srv.db.ListEvents(ctx, storage.EventFilter{WorkerID: "worker"}); len(evs) == 0 {
		t.Error("the worker that trained lost its events")
	}
}
