package data

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// Corpus is a token stream cut into a training part and a held-out validation part (its last 1%).
type Corpus struct {
	Source string // what was read, for messages
	Files  int    // files read (1 for a single file)
	tok8   []byte
	tok16  []uint16
	split  int // tokens [0, split) train, [split, Len) validation
}

// ErrNoData is returned when a path holds nothing to train on.
var ErrNoData = errors.New("no training data")

// GoRootSource is the job spec's name for the default corpus: the *.go files of the Go standard
// library of the Go that built (or runs next to) Shoal.
const GoRootSource = "$GOROOT/src"

// Load reads path: a nanoGPT .bin of little-endian uint16 tokens, a single text file (one token per
// byte), or a directory, whose regular files with one of exts as suffix and no path component
// starting with "." are concatenated in byte order of their relative paths — as the anchor's curve
// command does. path may begin with $GOROOT.
func Load(path string, exts []string) (*Corpus, error) {
	path, err := resolve(path)
	if err != nil {
		return nil, err
	}
	st, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrNoData, err)
	}
	c := &Corpus{Source: path}
	switch {
	case st.IsDir():
		b, n, err := readDir(path, exts)
		if err != nil {
			return nil, err
		}
		c.tok8, c.Files = b, n
	case strings.HasSuffix(path, ".bin"):
		b, err := os.ReadFile(path)
		if err != nil {
			return nil, err
		}
		if len(b)%2 != 0 {
			return nil, fmt.Errorf("%s: %d bytes is not a whole number of uint16 tokens", path, len(b))
		}
		c.tok16 = make([]uint16, len(b)/2)
		for i := range c.tok16 {
			c.tok16[i] = binary.LittleEndian.Uint16(b[2*i:])
		}
		c.Files = 1
	default:
		b, err := os.ReadFile(path)
		if err != nil {
			return nil, err
		}
		c.tok8, c.Files = b, 1
	}
	if c.Len() == 0 {
		return nil, fmt.Errorf("%w: %s holds no tokens", ErrNoData, path)
	}
	// The anchor computes int(len * 0.99) in double precision; so does this.
	c.split = int(float64(c.Len()) * 0.99)
	return c, nil
}

// resolve expands a leading $GOROOT.
func resolve(path string) (string, error) {
	if !strings.HasPrefix(path, "$GOROOT") {
		return path, nil
	}
	root, err := GoRoot()
	if err != nil {
		return "", err
	}
	return root + strings.TrimPrefix(path, "$GOROOT"), nil
}

// Check reports, without reading the corpus, whether Load could read path: that it exists, that
// a file opens and is not empty, that a directory holds a file ending in one of exts that opens.
// The error (wrapping ErrNoData) names the path as given and why, so that a job is refused when it
// is submitted rather than when its turn comes.
func Check(path string, exts []string) error {
	p, err := resolve(path)
	if err != nil {
		return err
	}
	what := fmt.Sprintf("%q", path)
	if p != path {
		what = fmt.Sprintf("%q (%s)", path, p)
	}
	st, err := os.Stat(p)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("%w: %s does not exist on the coordinator's machine", ErrNoData, what)
	case err != nil:
		return fmt.Errorf("%w: %s: %v", ErrNoData, what, err)
	case !st.IsDir() && st.Size() == 0:
		return fmt.Errorf("%w: %s is empty", ErrNoData, what)
	}
	if !st.IsDir() {
		f, err := os.Open(p)
		if err != nil {
			return fmt.Errorf("%w: %s cannot be read: %v", ErrNoData, what, err)
		}
		return f.Close()
	}
	errFound := errors.New("found")
	var first string
	err = walkData(p, exts, func(q string) error {
		first = q
		return errFound
	})
	switch {
	case first != "":
		f, err := os.Open(first)
		if err != nil {
			return fmt.Errorf("%w: %s: %s cannot be read: %v", ErrNoData, what, first, err)
		}
		return f.Close()
	case err != nil:
		return fmt.Errorf("%w: %s cannot be read: %v", ErrNoData, what, err)
	}
	return fmt.Errorf("%w: the directory %s holds no files ending in %q (data_extensions)", ErrNoData, what, exts)
}

// FromBytes makes a corpus of raw bytes, for tests and small inputs.
func FromBytes(b []byte) *Corpus {
	return &Corpus{Source: "bytes", Files: 1, tok8: b, split: int(float64(len(b)) * 0.99)}
}

// walkData calls fn with the path of every regular file under root whose name ends in one of exts,
// in lexical order, skipping hidden files and directories (a leading "."); an error from fn ends
// the walk and is returned.
func walkData(root string, exts []string, fn func(path string) error) error {
	return filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p != root && strings.HasPrefix(d.Name(), ".") {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		if !d.Type().IsRegular() {
			return nil
		}
		for _, e := range exts {
			if strings.HasSuffix(d.Name(), e) {
				return fn(p)
			}
		}
		return nil
	})
}

func readDir(root string, exts []string) ([]byte, int, error) {
	var files []string
	err := walkData(root, exts, func(p string) error {
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		files = append(files, rel)
		return nil
	})
	if err != nil {
		return nil, 0, fmt.Errorf("read corpus %s: %w", root, err)
	}
	if len(files) == 0 {
		return nil, 0, fmt.Errorf("%w: no files ending in %q under %s", ErrNoData, exts, root)
	}
	sort.Strings(files) // byte order of the relative paths
	var out []byte
	for _, f := range files {
		b, err := os.ReadFile(filepath.Join(root, f))
		if err != nil {
			return nil, 0, err
		}
		out = append(out, b...)
	}
	return out, len(files), nil
}

// Len is the number of tokens.
func (c *Corpus) Len() int {
	if c.tok16 != nil {
		return len(c.tok16)
	}
	return len(c.tok8)
}

// TrainLen and ValLen are the sizes of the two parts.
func (c *Corpus) TrainLen() int { return c.split }

// ValLen is the number of held-out tokens.
func (c *Corpus) ValLen() int { return c.Len() - c.split }

// MaxToken is the largest token id, to check against the model's vocabulary.
func (c *Corpus) MaxToken() int {
	m := 0
	if c.tok16 != nil {
		for _, t := range c.tok16 {
			m = max(m, int(t))
		}
		return m
	}
	for _, t := range c.tok8 {
		m = max(m, int(t))
	}
	return m
}

func (c *Corpus) window(off int, x, y []int32) {
	T := len(x)
	for i := 0; i < T; i++ {
		x[i], y[i] = c.at(off+i), c.at(off+i+1)
	}
}

func (c *Corpus) at(i int) int32 {
	if c.tok16 != nil {
		return int32(c.tok16[i])
	}
	return int32(c.tok8[i])
}

// Batch returns the inputs and targets (B rows of T tokens) of training step step: B windows of
// T+1 tokens at offsets drawn uniformly from the training part by a generator seeded from
// (seed, step) alone.
func (c *Corpus) Batch(seed uint64, step, B, T int) (x, y []int32, err error) {
	span := c.TrainLen() - T - 1
	if span < 1 {
		return nil, nil, fmt.Errorf("%w: training part of %d tokens is shorter than a window of %d", ErrNoData, c.TrainLen(), T+1)
	}
	r := rand.New(rand.NewPCG(seed*1000003+uint64(step), 0x5348_4f41_4c42_4154)) // "SHOALBAT"
	x, y = make([]int32, B*T), make([]int32, B*T)
	for b := 0; b < B; b++ {
		c.window(r.IntN(span), x[b*T:(b+1)*T], y[b*T:(b+1)*T])
	}
	return x, y, nil
}

// ValWindows are the validation loss's 32 fixed windows of T+1 tokens, evenly spaced across the
// held-out part exactly as the anchor places them: offset_i = i·(len−T−1) div 31.
const ValWindows = 32

// ValRows is the most validation windows one forward pass takes, so that the activations stay
// small. The anchor evaluates in passes of 16.
const ValRows = 16

// PassRows is how many validation windows one forward pass takes in a job whose training
// micro-batches are microRows sequences: ValRows, or fewer — the largest power of two not above
// microRows, so that the passes tile the ValWindows — when a micro-batch is smaller. A pass then
// never holds more activations than a training micro-batch: a large model's micro-batches are a
// sequence or two, and a pass of 16 would be most of a worker's memory (the 1B model's: 37 GB).
func PassRows(microRows int) int {
	p := ValRows
	for p > 1 && p > microRows {
		p /= 2
	}
	return p
}

// ValLoss combines the mean cross-entropies of the validation passes (rows windows each) into
// the mean over all windows, in one fixed order: the local run and the pipeline agree bit for bit.
func ValLoss(ces []float64, rows int) float64 {
	var s float64
	for _, ce := range ces {
		s += ce * float64(rows)
	}
	return s / float64(len(ces)*rows)
}

// Validation returns the inputs and targets of the validation windows (ValWindows rows of T).
func (c *Corpus) Validation(T int) (x, y []int32, err error) {
	n := c.ValLen()
	if n < T+1 {
		return nil, nil, fmt.Errorf("%w: validation part of %d tokens is shorter than a window of %d", ErrNoData, n, T+1)
	}
	x, y = make([]int32, ValWindows*T), make([]int32, ValWindows*T)
	for i := 0; i < ValWindows; i++ {
		off := c.split + i*(n-T-1)/(ValWindows-1)
		c.window(off, x[i*T:(i+1)*T], y[i*T:(i+1)*T])
	}
	return x, y, nil
}

// Windows returns the first n non-overlapping windows of T+1 tokens of the whole corpus, as the
// anchor's eval and grads commands take them (one batch of n rows).
func (c *Corpus) Windows(n, T int) (x, y []int32, err error) {
	if need := n * (T + 1); c.Len() < need {
		return nil, nil, fmt.Errorf("%s: %d tokens, need %d for %d windows of %d", c.Source, c.Len(), need, n, T+1)
	}
	x, y = make([]int32, n*T), make([]int32, n*T)
	for i := 0; i < n; i++ {
		c.window(i*(T+1), x[i*T:(i+1)*T], y[i*T:(i+1)*T])
	}
	return x, y, nil
}
