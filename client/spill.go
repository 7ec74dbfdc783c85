package client

import (
	"bytes"
	"io"
	"os"

	"github.com/shoal-ml/shoal/safetensors"
)

// A checkpoint shard or an audit's evidence is as large as the shard's state (12 bytes per
// parameter; the evidence twice that), and it is uploaded while the next steps run. Held in a
// growing bytes.Buffer it cost up to twice its size in memory at once (the buffer doubles and
// copies), on top of the shard — a worker of the large model capped at 1.2 GB peaked at 6 GB
// and was killed by the OS. So an upload is written to a file first (a spill) and streamed from
// it: the memory an upload costs is a copy buffer, and the shard may change again as soon as the
// file is written. Where there is no file system (a browser tab: Go's js/wasm os returns ENOSYS),
// it is held in memory, in one allocation of its final size when the size is known.

// spill is an upload body written once and read once — or, for evidence that must reach the
// coordinator through a lost connection, again from its start (again).
type spill struct {
	io.Reader
	file *os.File // nil when held in memory
	size int64
}

// newSpill runs write against a temporary file, or a buffer of sizeHint bytes (0: unknown) when
// no file can be made, and returns the body to upload. Close it after the upload.
func newSpill(sizeHint int64, write func(io.Writer) error) (*spill, error) {
	if f, err := os.CreateTemp("", "shoal-upload-*"); err == nil {
		// Unlinked at once on Unix: the file goes with its last descriptor, even if this
		// process is killed mid-upload.
		os.Remove(f.Name())
		sp := &spill{Reader: f, file: f}
		if err := write(f); err != nil {
			sp.Close()
			return nil, err
		}
		size, err := f.Seek(0, io.SeekCurrent)
		if err == nil {
			_, err = f.Seek(0, io.SeekStart)
		}
		if err != nil {
			sp.Close()
			return nil, err
		}
		sp.size = size
		return sp, nil
	}
	buf := bytes.NewBuffer(make([]byte, 0, max(sizeHint, 0)))
	if err := write(buf); err != nil {
		return nil, err
	}
	return &spill{Reader: bytes.NewReader(buf.Bytes()), size: int64(buf.Len())}, nil
}

// again returns a reader of the whole spill from its start, for another try at uploading it (an
// audit's evidence after a lost connection). It reads at offsets, so that tries share nothing but
// the bytes; it must not be used once the spill is closed.
func (s *spill) again() io.Reader {
	return io.NewSectionReader(s.Reader.(io.ReaderAt), 0, s.size)
}

// Close removes the spill's file.
func (s *spill) Close() error {
	if s.file == nil {
		return nil
	}
	name := s.file.Name()
	err := s.file.Close()
	os.Remove(name) // where unlinking an open file failed (Windows)
	return err
}

// stateBytes is the payload of ts, for a spill's size hint (headers add little).
func stateBytes(ts []safetensors.Tensor) int64 {
	var n int64
	for _, t := range ts {
		n += 4 * int64(len(t.Data))
	}
	return n
}
