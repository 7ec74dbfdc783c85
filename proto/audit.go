package proto

import (
	"encoding/base64"
	"fmt"
	"strconv"
	"strings"
)

// Verification (docs/design.md, "Verification and credit"). Every shard commits, in its step report, to what it computed:
// a digest of every tensor it sent (and to whom), of every tensor it received, and of the state
// (parameters and Adam's moments) it started the step from. The coordinator picks the shards it
// audits only after those commitments are in, so a worker cannot know which of its steps will be
// recomputed; a report without the commitment the job asks for is refused like any bad report.

// DigestLen is the length of a digest on the wire: 32 bytes (BLAKE3, or SHA-256 where a digest
// composes others: audit's state digests, the coordinator's custody), base64url without padding.
const DigestLen = 43

// MaxCommitEntries bounds each list of a Commit. The default job's stage sends and receives a few
// hundred tensors a step (activations, their gradients, expert rows in two groups per expert and
// micro-batch); at about 100 bytes an entry, two full lists stay well inside MaxMessageSize.
const MaxCommitEntries = 4096

// EncodeDigest writes a 32-byte digest as it travels.
func EncodeDigest(sum []byte) string { return base64.RawURLEncoding.EncodeToString(sum) }

// KeyID names a tensor within one step's commitment: kind, micro-batch, block and expert (the
// step and plan version are the report's). "2.1.3.4294967295" is micro-batch 1's activation
// into block 3.
func KeyID(k TensorKey) string {
	return strconv.Itoa(int(k.Kind)) + "." + strconv.FormatUint(uint64(k.MicroBatch), 10) + "." +
		strconv.FormatUint(uint64(k.Block), 10) + "." + strconv.FormatUint(uint64(k.Expert), 10)
}

// Commit is what a shard commits to in a training step's report.
type Commit struct {
	// State is the digest of the shard's state at the start of the step: its parameters and
	// Adam's moments, as model.StateDigest computes it. The next report's State therefore commits
	// to the update this step applied.
	State string `json:"state"`
	// Sent lists every tensor the shard sent to another worker, with its recipient.
	Sent []SentDigest `json:"sent"`
	// Recv lists every tensor the shard received: from neighbours, and the coordinator's tokens
	// and targets.
	Recv []KeyDigest `json:"recv"`
	// Boundary is set, in outer mode, on the first report after the shard's parameters changed
	// between two training steps: an outer step taken, or with a delay taken up.
	Boundary *OuterBoundary `json:"boundary,omitempty"`
}

// OuterBoundary ties an outer-mode shard's state across an outer step, which changes its
// parameters outside any training step: the state After's update reached (End with Moments),
// the state the reporting step starts from (Start with Moments, whose digest is the commit's
// State), and the global θ the outer step computed (Global), which every holder of a tensor must
// agree on. Each list holds a tensor digest (audit.TensorSums: the BLAKE3 of its float32 values)
// per state tensor, by its checkpoint name; the outer step leaves Adam's moments alone, so End and
// Start share them.
type OuterBoundary struct {
	After   uint64      `json:"after"`
	End     []KeyDigest `json:"end"`
	Start   []KeyDigest `json:"start"`
	Moments []KeyDigest `json:"moments"`
	Global  []KeyDigest `json:"global"`
}

// validate checks the shape of a boundary: bounded lists of named digests, no name twice in one.
func (b *OuterBoundary) validate() error {
	for _, l := range []struct {
		field string
		ds    []KeyDigest
	}{{"commit.boundary.end", b.End}, {"commit.boundary.start", b.Start}, {"commit.boundary.moments", b.Moments}, {"commit.boundary.global", b.Global}} {
		if err := checkTensorSums(l.field, l.ds, MaxCommitEntries); err != nil {
			return err
		}
	}
	return nil
}

// checkTensorSums checks a list of tensors' value hashes: at most max, each named once, with a
// name of at most 256 bytes and a well-formed digest.
func checkTensorSums(field string, ds []KeyDigest, max int) error {
	if len(ds) > max {
		return invalid(field, "%d tensors, at most %d", len(ds), max)
	}
	seen := make(map[string]bool, len(ds))
	for _, d := range ds {
		if d.Key == "" || len(d.Key) > 256 {
			return invalid(field, "tensor name of %d bytes", len(d.Key))
		}
		if seen[d.Key] {
			return invalid(field, "tensor %s twice", quote(d.Key))
		}
		seen[d.Key] = true
		if err := checkDigest(field, d.Digest); err != nil {
			return err
		}
	}
	return nil
}

// KeyDigest is one tensor of a commitment: its KeyID and digest (audit.TensorDigest).
type KeyDigest struct {
	Key    string `json:"k"`
	Digest string `json:"d"`
}

// SentDigest is a tensor sent to worker To.
type SentDigest struct {
	To     string `json:"to"`
	Key    string `json:"k"`
	Digest string `json:"d"`
}

// Validate checks the shape of a commitment: bounded lists, well-formed keys, digests and ids,
// no key twice (no key to one recipient twice, for what was sent). Whether it is true is the
// audit's business.
func (c *Commit) Validate() error {
	if err := checkDigest("commit.state", c.State); err != nil {
		return err
	}
	if len(c.Sent) > MaxCommitEntries || len(c.Recv) > MaxCommitEntries {
		return invalid("commit", "%d sent and %d received tensors, at most %d each", len(c.Sent), len(c.Recv), MaxCommitEntries)
	}
	seen := make(map[string]bool, len(c.Sent)+len(c.Recv))
	for _, s := range c.Sent {
		if err := checkID("commit.sent.to", s.To); err != nil {
			return err
		}
		if err := checkKeyDigest("commit.sent", s.Key, s.Digest); err != nil {
			return err
		}
		// One tensor may go to several workers (a gradient node to every other replica), each
		// once.
		k := s.To + "\x00" + s.Key
		if seen[k] {
			return invalid("commit.sent", "tensor %s to %s twice", quote(s.Key), s.To)
		}
		seen[k] = true
	}
	clear(seen)
	for _, r := range c.Recv {
		if err := checkKeyDigest("commit.recv", r.Key, r.Digest); err != nil {
			return err
		}
		if seen[r.Key] {
			return invalid("commit.recv", "tensor %s twice", quote(r.Key))
		}
		seen[r.Key] = true
	}
	if c.Boundary != nil {
		return c.Boundary.validate()
	}
	return nil
}

func checkKeyDigest(field, key, digest string) error {
	parts := strings.Split(key, ".")
	if len(parts) != 4 || len(key) > 48 {
		return invalid(field, "key %s, want kind.micro-batch.block.expert", quote(key))
	}
	for _, p := range parts {
		if _, err := strconv.ParseUint(p, 10, 32); err != nil || p != strconv.FormatUint(mustUint(p), 10) {
			return invalid(field, "key %s, want kind.micro-batch.block.expert in decimal", quote(key))
		}
	}
	return checkDigest(field, digest)
}

func mustUint(s string) uint64 { v, _ := strconv.ParseUint(s, 10, 32); return v }

func checkDigest(field, s string) error {
	if len(s) != DigestLen {
		return invalid(field, "digest of %d characters, want %d", len(s), DigestLen)
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return invalid(field, "digest is not base64url")
		}
	}
	return nil
}

// Audit asks a worker for the evidence of training step Step under plan PlanVersion: an audit
// bundle (package audit) POSTed to UploadPath — the state the shard started the step from, the
// tensors it received and sent, and the state it reached. The coordinator sends it after the
// worker has committed to the step's results and to the state that followed (the next step's
// report, or the final checkpoint), so a worker holds the evidence of its last completed step
// until its next update.
//
// Unapplied asks instead for the evidence of the step the worker reported last and has not
// applied: the coordinator disputes it (its holders of one tensor reported different norms) and
// sends no clip factor until the evidence is judged. Such a bundle has no end state.
//
// Lean says the coordinator recomputes with the worker's own kernel family, bit for bit: the
// bundle leaves out the end state and the tensors sent, whose digests the worker committed to
// already, and the coordinator compares its recomputation with those digests instead: about half
// the upload (docs/design.md, "Verification and credit").
//
// Sample, when not 0, asks for thin evidence (audit.Thin): of each large Adam moment of the start
// state only the groups this seed draws, with the chaining values of all its groups and of the
// end state's large tensors, and — where the evidence is not lean — of the end state's large
// tensors only the same groups: about 4.5 bytes a parameter of state instead of 12 (lean) or 24.
// The coordinator draws the seed when it asks, after the worker committed to the step.
type Audit struct {
	Step        uint64 `json:"step"`
	PlanVersion uint32 `json:"plan_version"`
	UploadPath  string `json:"upload_path"`
	Unapplied   bool   `json:"unapplied,omitempty"`
	Lean        bool   `json:"lean,omitempty"`
	Sample      uint64 `json:"sample,omitempty"`
}

func (*Audit) Type() MessageType { return TypeAudit }

func (m *Audit) Validate() error {
	if len(m.UploadPath) == 0 || m.UploadPath[0] != '/' {
		return invalid("upload_path", "%s must be an absolute path on the coordinator", quote(m.UploadPath))
	}
	return checkText("upload_path", m.UploadPath, 1024)
}

// AuditPath is where a worker uploads its bundle for step of the job's audit n.
func AuditPath(n int64) string { return fmt.Sprintf("/api/audits/%d", n) }
