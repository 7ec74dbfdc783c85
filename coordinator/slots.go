package coordinator

import (
	"sync"

	"github.com/google/uuid"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/proto"
)

// uploadSlot is a checkpoint shard the job loop has asked one worker for: the only upload
// POST /api/checkpoints/{id}/shards/{name} accepts, and what it must contain.
type uploadSlot struct {
	Worker string    // the worker the plan assigned the shard to: the only one that may upload it
	Job    uuid.UUID // the checkpoint's job
	Spec   job.Spec  // its model config is what the shard's tensors and metadata must match
	Step   int64     // steps completed at the checkpoint
	Shard  proto.Shard
	// Prefixes, in outer mode, are the names the shard's tensors go under (outerPrefixes); nil
	// for parameters and their Adam moments under their own names.
	Prefixes []string
}

type slotKey struct {
	checkpoint int64
	name       string
}

// uploadSlots is the registry of the checkpoint shards asked for and not landed yet. The job
// loop writes it when it asks for a checkpoint; the upload handler reads it. It lives in memory:
// after a coordinator restart the pending checkpoints' uploads are refused, those checkpoints
// never complete and are collected, and the job goes on from the newest complete one.
type uploadSlots struct {
	mu   sync.Mutex
	m    map[slotKey]uploadSlot
	busy map[slotKey]bool // an upload of the slot is in progress
}

// begin marks an upload of checkpoint ck's shard name as in progress; false if one already is.
func (u *uploadSlots) begin(ck int64, name string) bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	k := slotKey{ck, name}
	if u.busy[k] {
		return false
	}
	if u.busy == nil {
		u.busy = map[slotKey]bool{}
	}
	u.busy[k] = true
	return true
}

// end ends the upload begin started.
func (u *uploadSlots) end(ck int64, name string) {
	u.mu.Lock()
	defer u.mu.Unlock()
	delete(u.busy, slotKey{ck, name})
}

// expect records that checkpoint ck's shard name is to come from slot.Worker.
func (u *uploadSlots) expect(ck int64, name string, slot uploadSlot) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.m == nil {
		u.m = map[slotKey]uploadSlot{}
	}
	u.m[slotKey{ck, name}] = slot
}

// lookup returns the slot of checkpoint ck's shard name.
func (u *uploadSlots) lookup(ck int64, name string) (uploadSlot, bool) {
	u.mu.Lock()
	defer u.mu.Unlock()
	s, ok := u.m[slotKey{ck, name}]
	return s, ok
}

// landed removes a slot once its shard is recorded: a second upload of it is refused.
func (u *uploadSlots) landed(ck int64, name string) {
	u.mu.Lock()
	defer u.mu.Unlock()
	delete(u.m, slotKey{ck, name})
}

// forget removes the slots match selects: those of checkpoints older than a complete one (never
// restored from, and deleted), or of a job that ended. Their uploads are refused from then on,
// and the registry stays as small as the checkpoints still pending.
func (u *uploadSlots) forget(match func(uploadSlot) bool) {
	u.mu.Lock()
	defer u.mu.Unlock()
	for k, sl := range u.m {
		if match(sl) {
			delete(u.m, k)
		}
	}
}

// of returns the pending slots of checkpoint ck by shard name.
func (u *uploadSlots) of(ck int64) map[string]uploadSlot {
	u.mu.Lock()
	defer u.mu.Unlock()
	out := map[string]uploadSlot{}
	for k, sl := range u.m {
		if k.checkpoint == ck {
			out[k.name] = sl
		}
	}
	return out
}
