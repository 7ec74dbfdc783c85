package coordinator

import (
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/vulkan"
)

// TestClusterVulkanWorker: a pipeline of a worker on the CPU kernels and a worker computing its
// stage on a Vulkan device (`shoal worker --device vulkan`; Mesa's lavapipe on a machine without
// a GPU) trains the tiny job to the single process's losses and parameters within the
// cross-backend bounds of the browser's WebGPU runs (browserLossTol, browserParamTol: the Vulkan
// kernels agree with their Go references to ≤ 2e-7 relative on most ops, vulkan/validate_test.go,
// about what separates FMA from rounded products), and the coordinator shows the device. It skips without a
// Vulkan device unless SHOAL_VULKAN_REQUIRED=1 (.ci/run).
func TestClusterVulkanWorker(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a cluster run on a software GPU")
	}
	dev := openVulkan(t)
	spec := tinyJob(t, 4)
	spec.LR, spec.Warmup = 1e-2, 0 // docs/design.md's equivalence settings, as the browser runs use
	spec.Plan = &job.Plan{Stages: [][2]int{{0, 2}, {2, 4}}}
	want, ref, init := crossBackendReference(t, &spec)
	name := dev.Info().Name
	// Workers in id order hold the stages: w1, on Vulkan, the last (blocks 2–3, the head, the loss).
	c := startCluster(t, spec, 2, false, func(i int, cfg *client.WorkerConfig) {
		cfg.WorkerID = "w" + string(rune('0'+i))
		if i == 1 {
			cfg.Backend, cfg.Device, cfg.DeviceName = proto.BackendVulkan, dev, name
		}
	})
	shown := false
	c.mu.Lock()
	c.onStep = func(local.Report) { // on the job loop, while the workers are connected
		for _, p := range c.srv.peerStatus() { // what GET /api/status lists
			shown = shown || p.ID == "w1" && p.Backend == string(proto.BackendVulkan) && p.Device == name
		}
	}
	c.mu.Unlock()
	c.run(t)
	compareBrowserRun(t, c.reports, want, filepath.Join(c.srv.cfg.OutDir, local.CheckpointName(ref.Step)), ref, init)
	if err := dev.Err(); err != nil {
		t.Fatal(err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if !shown {
		t.Errorf("the status never showed w1 computing on vulkan (%s)", name)
	}
}

// TestClusterVulkanReplica: two step-mode pipeline replicas, one on the CPU kernels and one on a
// Vulkan device, share each step's micro-batches. Their gradients are the same bits (both sum the
// same tree nodes) but their ‖g‖² are summed on different devices: the coordinator takes them as
// one within replicaNormTol instead of disputing every step, and the run reaches the single
// process's losses and parameters within the cross-backend bounds, nobody banned.
func TestClusterVulkanReplica(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a cluster run on a software GPU")
	}
	dev := openVulkan(t)
	spec := tinyJob(t, 4)
	spec.LR, spec.Warmup = 1e-2, 0
	spec.Plan = &job.Plan{Replicas: []job.ReplicaPlan{{Stages: [][2]int{{0, 4}}, MicroBatches: 2}, {Stages: [][2]int{{0, 4}}, MicroBatches: 2}}}
	want, ref, init := crossBackendReference(t, &spec)
	var mu sync.Mutex
	var bad []string
	clusterConfig = func(cfg *Config) {
		cfg.OnEvent = func(kind, worker, detail string) {
			if kind == "peer.banned" || kind == "step.disputed" {
				mu.Lock()
				defer mu.Unlock()
				bad = append(bad, kind+" "+worker+" "+detail)
			}
		}
	}
	defer func() { clusterConfig = nil }()
	c := startCluster(t, spec, 2, false, func(i int, cfg *client.WorkerConfig) {
		cfg.WorkerID = "w" + string(rune('0'+i))
		if i == 1 {
			cfg.Backend, cfg.Device, cfg.DeviceName = proto.BackendVulkan, dev, dev.Info().Name
		}
	})
	c.run(t)
	mu.Lock()
	defer mu.Unlock()
	if len(bad) > 0 {
		t.Fatalf("a CPU replica and a Vulkan replica: %v", bad)
	}
	compareBrowserRun(t, c.reports, want, filepath.Join(c.srv.cfg.OutDir, local.CheckpointName(ref.Step)), ref, init)
}

// openVulkan opens Vulkan device 0 for the test, skipping without one unless
// SHOAL_VULKAN_REQUIRED=1 (.ci/run); it is closed when the test ends.
func openVulkan(t *testing.T) *vulkan.Device {
	t.Helper()
	infos, err := vulkan.Devices()
	if err != nil || len(infos) == 0 {
		if os.Getenv("SHOAL_VULKAN_REQUIRED") == "1" {
			t.Fatalf("no Vulkan device (%v) and SHOAL_VULKAN_REQUIRED=1", err)
		}
		t.Skipf("no Vulkan device: %v", err)
	}
	dev, err := vulkan.Open(0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dev.Close() })
	return dev
}

// crossBackendReference pins spec's data (fixedCorpus: which tokens sit near a top-k tie depends
// on it) and returns the single process's reports, final model and initial model, for
// compareBrowserRun.
func crossBackendReference(t *testing.T, spec *job.Spec) ([]local.Report, *model.Model, *model.Model) {
	t.Helper()
	spec.Data = fixedCorpus(t)
	want, ref := localReports(t, *spec)
	init, err := model.NewModel(spec.Model)
	if err != nil {
		t.Fatal(err)
	}
	init.Init(spec.Seed)
	return want, ref, init
}
