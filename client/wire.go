package client

import (
	"fmt"

	"github.com/shoal-ml/shoal/kernels"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
)

// Boundary tensors on the wire (model/wire.go has why every boundary is quantised): a stage's
// output and input gradient, an expert's rows both ways. The sender quantises what its model
// computed into the job's format and sends the codes; the receiver dequantises them into exactly
// the values that the model would have rounded them to had the boundary not crossed the network:
// kernels' Quantize/Dequantize pairs and the Round functions the model uses are the same scalar
// functions.

// dtypeOf is the frame dtype that carries format f.
func dtypeOf(f model.Format) proto.DType {
	switch f {
	case model.BF16:
		return proto.BF16
	case model.Int8:
		return proto.I8
	case model.Int4:
		return proto.I4
	}
	return proto.F32
}

// The I4 dtype's scale groups (proto, which imports nothing of Shoal's) are the kernels' quantiser's.
var _ [proto.I4Group - kernels.Int4Group]struct{}
var _ [kernels.Int4Group - proto.I4Group]struct{}

// matrix reports whether format f travels as a (rows, C) matrix whatever the tensor's shape: its
// scales are per row (int8) or per group of a row (int4).
func matrix(f model.Format) bool { return f == model.Int8 || f == model.Int4 }

// packRows returns the tensor key carrying x, rows of C, quantised to format f. dims is the
// tensor's shape in float32 ((B, T, C) for an activation, (n, C) for expert rows); an I8 or I4
// tensor is always the matrix (rows, C) its scales are per row (group of a row) of.
func packRows(key proto.TensorKey, f model.Format, x []float32, C int, dims ...int) (proto.Tensor, error) {
	if C < 1 || len(x)%C != 0 {
		return proto.Tensor{}, fmt.Errorf("%v: %d values are not rows of %d", key, len(x), C)
	}
	rows := len(x) / C
	if matrix(f) {
		dims = []int{rows, C}
	}
	sh, err := proto.ShapeOf(dims...)
	if err != nil {
		return proto.Tensor{}, err
	}
	t := proto.Tensor{Key: key, DType: dtypeOf(f), Shape: sh}
	switch f {
	case model.BF16:
		h := make([]uint16, len(x))
		kernels.QuantizeBF16(h, x)
		t.Data = proto.AppendBF16s(make([]byte, 0, 2*len(x)), h)
	case model.Int8:
		q, scale := make([]int8, len(x)), make([]float32, rows)
		kernels.QuantizeInt8(q, scale, x, C)
		t.Data = proto.AppendI8Rows(make([]byte, 0, f.Bytes(rows, C)), scale, q)
	case model.Int4:
		codes, scales := make([]byte, rows*((C+1)/2)), make([]uint16, rows*kernels.Int4Groups(C))
		kernels.QuantizeInt4(codes, scales, x, C)
		t.Data = proto.AppendI4Rows(make([]byte, 0, f.Bytes(rows, C)), scales, codes)
	default:
		t.Data = proto.AppendFloat32s(make([]byte, 0, 4*len(x)), x)
	}
	return t, nil
}

// unpackRows returns the values of t, which must be rows of C in format f — rows of them, or any
// number when rows < 0 — dequantised as the sender's model rounded them.
func unpackRows(t proto.Tensor, f model.Format, rows, C int) ([]float32, error) {
	if want := dtypeOf(f); t.DType != want {
		return nil, fmt.Errorf("%v: a %v tensor, this job's wire sends it as %v (%v)", t.Key, t.DType, want, f)
	}
	// Expert rows are (n, C) in every format, and so is any I8 or I4 tensor; an activation
	// (B, T, C).
	if (rows < 0 || matrix(f)) && t.Shape[1] != uint32(C) {
		return nil, fmt.Errorf("%v: rows of %d, want %d", t.Key, t.Shape[1], C)
	}
	n := len(t.Data) / t.DType.Size() // the elements, but for I8 and I4, whose shape says them
	if matrix(f) {
		n = int(t.Shape[0]) * C
	}
	if n%C != 0 || rows >= 0 && n != rows*C {
		return nil, fmt.Errorf("%v: %d values of shape %v, want %d rows of %d", t.Key, n, t.Shape, rows, C)
	}
	switch f {
	case model.BF16:
		h, err := proto.BF16s(t.Data)
		if err != nil {
			return nil, err
		}
		x := make([]float32, len(h))
		kernels.DequantizeBF16(x, h)
		return x, nil
	case model.Int8:
		scale, q, err := proto.I8Rows(t.Data, n/C, C)
		if err != nil {
			return nil, fmt.Errorf("%v: %w", t.Key, err)
		}
		x := make([]float32, n)
		kernels.DequantizeInt8(x, q, scale, C)
		return x, nil
	case model.Int4:
		scales, codes, err := proto.I4Rows(t.Data, n/C, C)
		if err != nil {
			return nil, fmt.Errorf("%v: %w", t.Key, err)
		}
		x := make([]float32, n)
		kernels.DequantizeInt4(x, codes, scales, C)
		return x, nil
	}
	return proto.Float32s(t.Data)
}
