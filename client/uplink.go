package client

import (
	"context"
	"io"

	"golang.org/x/time/rate"

	"github.com/shoal-ml/shoal/proto"
)

// Uplink caps the bytes a worker sends (WorkerConfig.MaxUploadBytesPerS, `shoal worker
// --max-upload`): the data plane's frames to its neighbours, over WebRTC or the coordinator's
// relay, and its checkpoint and evidence uploads, all from one token bucket, so that a
// volunteer's household keeps its upstream. Control messages (heartbeats, reports) are not
// counted: they are small, and holding one back would only make a link look dead.
type Uplink struct {
	lim *rate.Limiter
}

// NewUplink returns a cap of bytesPerS; nil (no cap) when bytesPerS ≤ 0. Its burst is one frame
// or a tenth of a second at the rate, whichever is more: a frame passes whole, and the link is
// never idle while tokens accrue.
func NewUplink(bytesPerS float64) *Uplink {
	if !(bytesPerS > 0) {
		return nil
	}
	burst := max(proto.MaxFrameSize, int(min(bytesPerS/10, 1<<30)))
	return &Uplink{lim: rate.NewLimiter(rate.Limit(bytesPerS), burst)}
}

// wait takes n bytes' worth of tokens, a burst at a time; a nil Uplink takes none.
func (u *Uplink) wait(ctx context.Context, n int) error {
	if u == nil {
		return nil
	}
	for n > 0 {
		k := min(n, u.lim.Burst())
		if err := u.lim.WaitN(ctx, k); err != nil {
			return err
		}
		n -= k
	}
	return nil
}

// reader paces r's bytes through u: each read is at most a burst, and returns once its bytes'
// tokens are taken (ctx ends the wait). A nil Uplink returns r.
func (u *Uplink) reader(ctx context.Context, r io.Reader) io.Reader {
	if u == nil {
		return r
	}
	return &pacedReader{ctx: ctx, r: r, u: u}
}

type pacedReader struct {
	ctx context.Context
	r   io.Reader
	u   *Uplink
}

func (p *pacedReader) Read(b []byte) (int, error) {
	if len(b) > p.u.lim.Burst() {
		b = b[:p.u.lim.Burst()]
	}
	n, err := p.r.Read(b)
	if n > 0 {
		if werr := p.u.lim.WaitN(p.ctx, n); werr != nil {
			return n, werr
		}
	}
	return n, err
}
