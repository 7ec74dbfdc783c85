package coordinator

// Volunteers' identities (proto/identity.go, docs/design.md "Trust"): the hub admits a worker
// that claims a key only once it has signed a fresh challenge with it, so that a peer's identity
// here is always one its holder proved. Credit is recorded under the identity (storage.Work), and
// a ban covers it — every worker of that volunteer, now and later, in the job — and, for
// Config.BanAddressFor, the banned worker's address, against a cheater that returns under a
// fresh id and a fresh key.

import (
	"context"
	"time"

	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/storage"
)

// identity is the fingerprint of the key p proved it holds; "" for a peer without one.
func (p *peer) identity() string {
	if p == nil || p.hello == nil {
		return ""
	}
	return proto.Fingerprint(p.hello.SigningKey)
}

// loadBans takes in the job's stored bans: their identities stay banned from the job, and the
// hub refuses them at their hello.
func (j *jobRun) loadBans(ctx context.Context) error {
	bans, err := j.s.db.Bans(ctx, j.rec.ID)
	if err != nil {
		return err
	}
	ids := map[string]bool{}
	for _, b := range bans {
		if b.Identity != "" {
			ids[b.Identity] = true
		}
	}
	j.bannedIDs = ids
	cp := make(map[string]bool, len(ids))
	for k := range ids {
		cp[k] = true
	}
	j.s.bans.setJob(cp)
	return nil
}

// loadAddrBans takes in the addresses of the bans made within BanAddressFor, in any job.
func (s *Server) loadAddrBans(ctx context.Context) error {
	if s.cfg.BanAddressFor <= 0 {
		return nil
	}
	addrs, err := s.db.BannedAddrs(ctx, time.Now().Add(-s.cfg.BanAddressFor))
	if err != nil {
		return err
	}
	for a, at := range addrs {
		s.bans.ban("", a, at.Add(s.cfg.BanAddressFor))
	}
	return nil
}

// recordBan stores worker's ban from the job with its identity and (when addresses are banned)
// its address, refuses both at the hub from now on, and drops the identity's other workers: a
// volunteer caught cheating on one tab is not trusted on another.
func (j *jobRun) recordBan(ctx context.Context, worker, reason string, step int) error {
	p := j.peers[worker]
	if p == nil {
		p = j.s.joined[worker] // it left before its ban (an abandoned audit)
	}
	b := storage.Ban{Worker: worker, Reason: reason, Step: int64(step), Identity: p.identity()}
	if p != nil && j.s.cfg.BanAddressFor > 0 {
		b.Addr = p.addr
	}
	if err := j.s.db.BanWorker(ctx, j.rec.ID, b); err != nil {
		return err
	}
	j.s.bans.ban(b.Identity, b.Addr, time.Now().Add(j.s.cfg.BanAddressFor))
	if b.Identity == "" {
		return nil
	}
	if j.bannedIDs == nil {
		j.bannedIDs = map[string]bool{}
	}
	j.bannedIDs[b.Identity] = true
	for id, q := range j.peers {
		if id != worker && q.identity() == b.Identity {
			j.s.hub.Drop(id, &proto.Error{Code: proto.ErrCodeBanned, Message: "banned from this job: this volunteer's identity was caught on another worker: " + reason})
		}
	}
	return nil
}

// DefaultWorkerRetention is Config.WorkerRetention's default.
const DefaultWorkerRetention = 24 * time.Hour

// markTookPart records, in order after their joins, that the workers of work took part in a
// step, so that their rows never expire.
func (s *Server) markTookPart(work []storage.Work) {
	var ids []string
	for _, w := range work {
		if !s.tookPart[w.Worker] {
			ids = append(ids, w.Worker)
		}
	}
	if len(ids) == 0 {
		return
	}
	if s.tookPart == nil {
		s.tookPart = map[string]bool{}
	}
	for _, id := range ids {
		s.tookPart[id] = true
	}
	s.rec.record("workers took part", func(tx *storage.Tx) error { return tx.MarkTookPart(context.Background(), ids...) })
}

// pruneWorkers deletes, every so often until ctx ends, the rows of workers that never took part
// and left more than WorkerRetention ago: a wave of joins that never worked leaves nothing
// lasting. It returns when ctx ends.
func (s *Server) pruneWorkers(ctx context.Context) {
	keep := s.cfg.WorkerRetention
	if keep <= 0 {
		keep = DefaultWorkerRetention
	}
	t := time.NewTicker(min(max(keep/4, time.Second), time.Hour))
	defer t.Stop()
	for {
		if n, err := s.db.PruneWorkers(ctx, time.Now().Add(-keep)); err != nil && ctx.Err() == nil {
			s.log.Warn("prune the rows of workers that never took part", "err", err)
		} else if n > 0 {
			s.log.Info("pruned the rows of workers that never took part", "workers", n, "gone_for", keep)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// maxJoinedMemory bounds Server.joined: past it, the memory starts over. A worker banned after
// it left is banned within minutes of its departure (its audit's wait), long before a wave of
// this many joins has passed.
const maxJoinedMemory = 1 << 16

// remember notes p's identity and address for a ban that comes after it left.
func (s *Server) remember(p *peer) {
	if s.joined == nil || len(s.joined) >= maxJoinedMemory {
		s.joined = map[string]*peer{}
	}
	s.joined[p.id] = p
}
