package model

import (
	"errors"
	"fmt"

	"github.com/shoal-ml/shoal/kernels"
)

// Compressed boundaries (docs/design.md, "Compressed boundaries"; issues 17 and 31). A job may
// carry the tensors that cross a boundary as bfloat16, as int8 with one scale per row or as int4
// with one scale per group of 32 values, to send less. The quantisation is part of the model, not
// of the network: the numbers a job computes must not depend on its plan — it replays after failures, replans mid-job with other stage cuts, and moves
// experts between a stage and a host — so every boundary is quantised whether or not it crosses
// the network in the current plan:
//
//   - the residual stream entering every block after block 0, forward, and its gradient,
//     backward: inside a Stage between its blocks (Stage.Wire), and between stages by whoever
//     carries a stage's output (it is handed out unquantised, Stage.Forward's X and Backward's
//     result) — the sender quantises it, the receiver gets the dequantised values;
//   - every expert dispatch and combine: each expert's input rows and output rows forward, their
//     gradients backward. LocalExperts rounds them around the expert it runs here
//     (ForwardExpert, BackwardExpert); a remote expert's rows are quantised by their sender and
//     dequantised by their receiver.
//
// A value that crosses a boundary is therefore always dequantise(quantise(x)) of the value its
// producer computed, computed once, by the same functions (package kernels) on the same bits,
// whichever process does it: the single process and every split agree bit for bit.
//
// Backward through a boundary is straight-through: quantise∘dequantise is treated as the identity
// for the gradient flowing through it (its true derivative is zero almost everywhere), and that
// gradient is itself a boundary tensor, quantised in the gradients format where it crosses. So a
// block's output gradient is round_g(∂L/∂(next block's input)), an expert's output gradient is
// round_g(w·∂L/∂out), and the stage combines round_g of each expert's input gradient.
//
// What is not a boundary: block 0's input (the embeddings are computed where they are used), the
// last block's output (ln_f follows on the same stage), and an expert replica's partial weight
// gradient (a parameter gradient, exchanged in float32 so that both replicas end on the single
// process's bits).

// Format is how a boundary tensor is represented when it crosses: its values after crossing are
// Round's.
type Format uint8

const (
	// F32 is float32 as computed: crossing changes nothing. The zero Format, so that a model
	// built without a Wire computes exactly what it did before formats existed.
	F32 Format = iota
	// BF16 is bfloat16, each value rounded to nearest-even (kernels.BF16Bits): 2 bytes a value.
	BF16
	// Int8 is int8 with one float32 scale per row of C (kernels.Int8Scale, Int8Quant): C + 4
	// bytes a row.
	Int8
	// Int4 is int4 with one bfloat16 scale per group of 32 values of a row (kernels.Int4Scale,
	// Int4Quant): 4.5 bits a value, 7.1× fewer bytes than F32 and 1.8× fewer than Int8, for links
	// where Int8 still limits the step (docs/benchmarks.md, "Compressed boundaries", has its cost).
	Int4
	formatEnd
)

var formatNames = [...]string{"f32", "bf16", "int8", "int4"}

func (f Format) String() string {
	if f < formatEnd {
		return formatNames[f]
	}
	return fmt.Sprintf("format(%d)", uint8(f))
}

// ErrFormat is wrapped by errors about a wire format's name or value.
var ErrFormat = errors.New("invalid wire format")

// ParseFormat returns the Format called s: "f32", "bf16", "int8" or "int4".
func ParseFormat(s string) (Format, error) {
	for i, n := range formatNames {
		if s == n {
			return Format(i), nil
		}
	}
	return 0, fmt.Errorf("%w %q: want \"f32\", \"bf16\", \"int8\" or \"int4\"", ErrFormat, s)
}

// MarshalText writes f's name.
func (f Format) MarshalText() ([]byte, error) {
	if f >= formatEnd {
		return nil, fmt.Errorf("%w: %v", ErrFormat, f)
	}
	return []byte(f.String()), nil
}

// UnmarshalText reads a name ParseFormat accepts.
func (f *Format) UnmarshalText(b []byte) error {
	v, err := ParseFormat(string(b))
	if err != nil {
		return err
	}
	*f = v
	return nil
}

// Round replaces x, rows of C values, by the values it has after crossing a boundary in format
// f: dequantise(quantise(x)), exactly what the receiver of the quantised tensor computes.
func (f Format) Round(x []float32, C int) {
	switch f {
	case BF16:
		kernels.RoundBF16(x)
	case Int8:
		kernels.RoundInt8(x, C)
	case Int4:
		kernels.RoundInt4(x, C)
	}
}

// Bytes is the size of rows×C values in format f on the wire: the payload of a boundary tensor.
func (f Format) Bytes(rows, C int) int {
	switch f {
	case BF16:
		return 2 * rows * C
	case Int8:
		return rows * (C + 4)
	case Int4:
		return rows * kernels.Int4RowBytes(C)
	}
	return 4 * rows * C
}

// Wire is a job's boundary formats: Activations for what flows forward (a stage's input, an
// expert's input and output rows), Gradients for what flows backward (their gradients). It is
// part of the job's definition, like the number of micro-batches: two runs agree bit for bit only
// with the same Wire. The zero Wire is float32 both ways.
type Wire struct {
	Activations Format `json:"activations"`
	Gradients   Format `json:"gradients"`
}

var wireKeys = []string{"activations", "gradients"}

// UnmarshalJSON decodes a wire object that names both formats and nothing else: a format left out
// is an error, not float32 by default.
func (w *Wire) UnmarshalJSON(b []byte) error {
	type plain Wire
	var v plain
	if err := strictJSON(b, &v, wireKeys); err != nil {
		return fmt.Errorf("wire: %w", err)
	}
	*w = Wire(v)
	return nil
}

// Validate reports a format out of range (only a Wire built in code can hold one).
func (w Wire) Validate() error {
	for _, f := range []Format{w.Activations, w.Gradients} {
		if f >= formatEnd {
			return fmt.Errorf("%w: %v", ErrFormat, f)
		}
	}
	return nil
}

func (w Wire) String() string {
	return fmt.Sprintf("activations %v, gradients %v", w.Activations, w.Gradients)
}

// SetWire makes the shard quantise at its boundaries in w's formats: between its stage's blocks
// and around the experts it runs (see "Compressed boundaries" above). Set it before the first
// step; a shard starts with the zero Wire, float32.
func (sh *Shard) SetWire(w Wire) {
	if sh.Stage != nil {
		sh.Stage.Wire = w
	}
	if sh.Experts != nil {
		sh.Experts.Wire = w
	}
}

// cross gives b, rows of C on the stage's device, the values it has after crossing a block
// boundary in format f. Off Host that is a read and a write of b: the rounding is host code, so
// that every device rounds exactly as the receiver of a sent tensor does.
func (s *Stage) cross(b Buf, f Format, C int) {
	if f == F32 {
		return
	}
	h := readView(s.dev, b, &s.crossHost)
	f.Round(h, C)
	publish(s.dev, b, h)
}

// ForwardExpert runs expert x of this set on rows in (n×C) as if they had been sent to it and its
// output sent back: in is rounded to the activations format in place, and so is the output.
func (l *LocalExperts) ForwardExpert(x *Expert, mb int, in []float32) ([]float32, error) {
	return l.forwardExpert(x, mb, in, nil, 0)
}

// forwardExpert is ForwardExpert in the memory of br from row off on (Expert.forward).
func (l *LocalExperts) forwardExpert(x *Expert, mb int, in []float32, br *blockRows, off int) ([]float32, error) {
	C := x.cfg.NEmbd
	l.Wire.Activations.Round(in, C)
	y, err := x.forward(mb, in, br, off)
	if err != nil {
		return nil, err
	}
	l.Wire.Activations.Round(y, C)
	return y, nil
}

// BackwardExpert is ForwardExpert's backward: the output gradient dy is rounded to the gradients
// format in place, and so is the input gradient it returns.
func (l *LocalExperts) BackwardExpert(x *Expert, mb int, dy []float32, split int) ([]float32, error) {
	return l.backwardExpert(x, mb, dy, split, &x.own, nil)
}

// backwardExpert is BackwardExpert with working memory sc, into dx when given (Expert.backward).
func (l *LocalExperts) backwardExpert(x *Expert, mb int, dy []float32, split int, sc *expertScratch, dx []float32) ([]float32, error) {
	C := x.cfg.NEmbd
	l.Wire.Gradients.Round(dy, C)
	dx, err := x.backward(mb, dy, split, sc, dx)
	if err != nil {
		return nil, err
	}
	l.Wire.Gradients.Round(dx, C)
	return dx, nil
}
