package sched

import (
	"fmt"
	"slices"
	"testing"
)

// TestPaceShares: the min-max allocation of micro-batches to measured paces, checked against every
// split by brute force.
func TestPaceShares(t *testing.T) {
	for _, c := range []struct {
		pace []float64
		M    int
		want []int
	}{
		{[]float64{1, 1}, 4, []int{2, 2}},
		{[]float64{1, 3}, 4, []int{3, 1}},
		{[]float64{3, 1}, 8, []int{2, 6}},
		{[]float64{1, 1, 1}, 4, []int{2, 1, 1}}, // ties to the lower position
		{[]float64{1, 100}, 4, []int{3, 1}},     // every replica keeps one
		{[]float64{1, 2, 4}, 7, []int{4, 2, 1}},
		{[]float64{1, 1}, 1, nil},  // fewer micro-batches than replicas
		{[]float64{1, 0}, 4, nil},  // a pace not measured
		{[]float64{1, -1}, 4, nil}, // nor a false one
		{nil, 4, nil},
	} {
		got := PaceShares(c.pace, nil, c.M)
		if !slices.Equal(got, c.want) {
			t.Errorf("PaceShares(%v, %d) = %v, want %v", c.pace, c.M, got, c.want)
		}
		if got == nil {
			continue
		}
		// No split of M with at least one each has a shorter step.
		best := bestSplit(c.pace, c.M)
		if st := StepTime(got, c.pace); st > best+1e-12 {
			t.Errorf("PaceShares(%v, %d) = %v: step %v, the best split's %v", c.pace, c.M, got, st, best)
		}
	}
}

// TestPaceSharesCaps: no replica is given more than its workers' memory holds; caps that cannot
// hold the step give no split.
func TestPaceSharesCaps(t *testing.T) {
	if got := PaceShares([]float64{1, 3}, []int{2, 4}, 4); !slices.Equal(got, []int{2, 2}) {
		t.Errorf("the fast replica capped at 2: %v, want [2 2]", got)
	}
	if got := PaceShares([]float64{1, 3}, []int{4, 4}, 4); !slices.Equal(got, []int{3, 1}) {
		t.Errorf("caps that do not bind: %v, want [3 1]", got)
	}
	if got := PaceShares([]float64{1, 1}, []int{1, 2}, 4); got != nil {
		t.Errorf("caps of 3 for 4 micro-batches: %v, want nil", got)
	}
	if v := WeighRebalance([]int{2, 2}, []float64{0.1, 0.3}, []int{2, 4}, 100, 0.01); v.Pays || v.Shares != nil {
		t.Errorf("a rebalance past a cap: %+v", v)
	}
}

func bestSplit(pace []float64, M int) float64 {
	best := -1.0
	n := make([]int, len(pace))
	var rec func(r, left int)
	rec = func(r, left int) {
		if r == len(n)-1 {
			if left < 1 {
				return
			}
			n[r] = left
			if st := StepTime(n, pace); best < 0 || st < best {
				best = st
			}
			return
		}
		for k := 1; k <= left-(len(n)-1-r); k++ {
			n[r] = k
			rec(r+1, left-k)
		}
	}
	rec(0, M)
	return best
}

// TestWeighRebalance: a change of shares is made only when the step gets faster by the minimum
// gain and repays its cost within the horizon.
func TestWeighRebalance(t *testing.T) {
	for _, c := range []struct {
		name string
		n    []int
		pace []float64
		left int
		cost float64
		pays bool
	}{
		{"a replica three times slower", []int{2, 2}, []float64{0.1, 0.3}, 100, 1, true},
		{"already shared by pace", []int{3, 1}, []float64{0.1, 0.3}, 100, 1, false},
		{"a gain within the noise", []int{2, 2}, []float64{0.1, 0.16}, 100, 0.01, false},
		{"too few steps left to repay it", []int{2, 2}, []float64{0.1, 0.3}, 3, 1, false},
		{"a costly change", []int{2, 2}, []float64{0.1, 0.3}, 1000, 5, false},
		{"one replica", []int{4}, []float64{0.1}, 100, 0, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			v := WeighRebalance(c.n, c.pace, nil, c.left, c.cost)
			if v.Pays != c.pays {
				t.Fatalf("pays %v (%s), want %v", v.Pays, v.Why, c.pays)
			}
			if v.Pays && (v.Shares == nil || v.After >= v.Before) {
				t.Fatalf("a change that pays: %+v", v)
			}
			t.Log(v.Why)
		})
	}
}

// TestWeightedShares: M micro-batches in proportion to the weights, at least one each, summing
// to M, the remainder to the largest fractions.
func TestWeightedShares(t *testing.T) {
	for _, c := range []struct {
		w    []int
		M    int
		want []int
	}{
		{[]int{2, 2}, 4, []int{2, 2}},
		{[]int{3, 1}, 4, []int{3, 1}},
		{[]int{6, 6, 6}, 4, []int{2, 1, 1}},
		{[]int{100, 1, 1}, 6, []int{4, 1, 1}},
		{[]int{1, 2, 3}, 12, []int{2, 4, 6}},
	} {
		got := WeightedShares(c.w, c.M)
		if fmt.Sprint(got) != fmt.Sprint(c.want) {
			t.Errorf("WeightedShares(%v, %d) = %v, want %v", c.w, c.M, got, c.want)
		}
	}
}
