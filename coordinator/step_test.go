package coordinator

import (
	"testing"
	"time"

	"github.com/shoal-ml/shoal/job"
)

func TestDeadlineFollowsMeasuredSteps(t *testing.T) {
	spec := job.Default()
	spec.StepDeadlineMinS, spec.StepDeadlineMaxS = 2, 60
	j := &jobRun{spec: spec}
	tests := []struct {
		name  string
		times []time.Duration
		want  time.Duration
	}{
		{"nothing measured: the ceiling", nil, time.Minute},
		{"fast steps: the floor", []time.Duration{10 * time.Millisecond, 20 * time.Millisecond}, 2 * time.Second},
		{"median times the factor", []time.Duration{time.Second, 3 * time.Second, 5 * time.Second}, 12 * time.Second},
		{"an outlier does not move it", []time.Duration{3 * time.Second, 3 * time.Second, time.Hour}, 12 * time.Second},
		{"slow steps: the ceiling", []time.Duration{time.Minute}, time.Minute},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			j.stepTimes = tc.times
			if got := j.deadline(); got != tc.want {
				t.Errorf("deadline %v, want %v", got, tc.want)
			}
		})
	}
}
