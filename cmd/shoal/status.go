package main

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/url"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/shoal-ml/shoal/client"
)

// The CLI decodes GET /api/status into its own mirror of coordinator.Status rather than the
// coordinator's types: `shoal status` is an HTTP client, often of a coordinator built from another
// version, and should read what the wire says; it also keeps the coordinator's internals out of the
// client's reach. TestStatusMirrorsCoordinator fails when coordinator.Status gains a field this
// mirror does not know.

// statusJSON mirrors coordinator.Status.
type statusJSON struct {
	Job    *jobJSON          `json:"job"`
	Steps  []stepStatusJSON  `json:"steps"` // oldest first
	Plan   *planJSON         `json:"plan"`
	Peers  []peerJSON        `json:"peers"`
	Router map[int][]int     `json:"router"` // the last step's tokens per expert, by MoE block
	Events []eventStatusJSON `json:"events"` // oldest first
	Now    time.Time         `json:"now"`    // the coordinator's clock
	// Verification: the audit summary, the credit leaderboard and the bans.
	Audit   *auditJSON   `json:"audit,omitempty"`
	Credits []creditJSON `json:"credits"`
	Bans    []banJSON    `json:"bans"`
	// Volunteer is the total over every job of the volunteer --volunteer names.
	Volunteer *creditJSON `json:"volunteer,omitempty"`
}

type auditJSON struct {
	Rate          float64 `json:"rate"`
	Window        int     `json:"window"`
	Audits        int64   `json:"audits"`
	Passed        int64   `json:"passed"`
	Failed        int64   `json:"failed"`
	Inconclusive  int64   `json:"inconclusive"`
	RecomputeS    float64 `json:"recompute_s"`
	ComputeShare  float64 `json:"compute_share"`
	EvidenceBytes int64   `json:"evidence_bytes"`
}

type creditJSON struct {
	Worker               string  `json:"worker"`
	Identity             string  `json:"identity,omitempty"`
	Name                 string  `json:"name,omitempty"`
	VerifiedMicroBatches int64   `json:"verified_micro_batches"`
	PendingMicroBatches  int64   `json:"pending_micro_batches"`
	RejectedMicroBatches int64   `json:"rejected_micro_batches"`
	VerifiedGFLOP        float64 `json:"verified_gflop"`
	PendingGFLOP         float64 `json:"pending_gflop"`
}

type banJSON struct {
	Worker   string    `json:"worker"`
	Identity string    `json:"identity,omitempty"`
	Reason   string    `json:"reason"`
	Step     int64     `json:"step"`
	Time     time.Time `json:"time"`
}

type jobJSON struct {
	ID    string `json:"id"`
	State string `json:"state"`
	Phase string `json:"phase,omitempty"` // where the job loop is with its plan
	Step  int    `json:"step"`            // steps completed
	Steps int    `json:"steps"`
	Model string `json:"model"` // the model and batch in words
	// ModelConfig is the job's model config (what `shoal worker --device auto` times).
	ModelConfig json.RawMessage `json:"model_config,omitempty"`
	// Waiting says why the job waits for workers; "" when it does not.
	Waiting string `json:"waiting,omitempty"`
}

type stepStatusJSON struct {
	Step       int      `json:"step"` // 0-based
	Loss       float64  `json:"loss"`
	Aux        float64  `json:"aux"`
	ValLoss    *float64 `json:"val_loss,omitempty"`
	TokensPerS float64  `json:"tokens_per_s"`
	Stages     []struct {
		Peer       string  `json:"peer"`
		ComputeMS  float64 `json:"compute_ms"`
		WaitMS     float64 `json:"wait_ms"`
		TransferMS float64 `json:"transfer_ms"`
	} `json:"stages,omitempty"`
}

type planJSON struct {
	Version      uint32            `json:"version"`
	Stages       []stageJSON       `json:"stages"`
	ExpertHosts  []expertHostJSON  `json:"expert_hosts"`
	Standby      []string          `json:"standby"`
	Depth        int               `json:"depth"`
	Replicas     int               `json:"replicas"`
	Sync         string            `json:"sync"`
	OwnBatches   bool              `json:"own_batches,omitempty"`
	Delay        int               `json:"delay,omitempty"`
	WarmupUntil  int               `json:"warmup_until,omitempty"`
	ReplicaSteps []int             `json:"replica_steps,omitempty"`
	Choice       string            `json:"choice,omitempty"`
	FromStep     int               `json:"from_step"`
	KeptFrom     uint32            `json:"kept_from,omitempty"`
	Pools        []poolJSON        `json:"pools,omitempty"`
	TookFrom     map[string]string `json:"took_from,omitempty"`
}

type poolJSON struct {
	Blocks  [2]int   `json:"blocks"`
	Members []string `json:"members"`
}

type stageJSON struct {
	Blocks       [2]int `json:"blocks"` // [begin, end)
	Peer         string `json:"peer"`
	PeerName     string `json:"peer_name,omitempty"`
	Replica      int    `json:"replica"`
	MicroBatches [2]int `json:"micro_batches"` // its replica's, [first, end) of every step
}

type expertHostJSON struct {
	Block    int    `json:"block"`
	Experts  []int  `json:"experts"`
	Peer     string `json:"peer"`
	PeerName string `json:"peer_name,omitempty"`
}

type peerJSON struct {
	ID string `json:"id"`
	// Name is not sent by every coordinator; names are also taken from the plan and join events.
	Name      string    `json:"name,omitempty"`
	Kind      string    `json:"kind"`
	Backend   string    `json:"backend"`
	Device    string    `json:"device,omitempty"`
	GFLOPS    float64   `json:"gflops"`
	Joined    time.Time `json:"joined"`
	LastHeard time.Time `json:"last_heard"`
	BytesIn   int64     `json:"bytes_in"`
	BytesOut  int64     `json:"bytes_out"`
	// MicroBatches and BytesSent are what the peer computed and sent in this job.
	MicroBatches int64 `json:"micro_batches"`
	BytesSent    int64 `json:"bytes_sent"`
	// Flagged peers delivered far below their claimed GFLOPS; the planner uses PlannedGFLOPS.
	Flagged       bool    `json:"flagged,omitempty"`
	PlannedGFLOPS float64 `json:"planned_gflops,omitempty"`
}

type eventStatusJSON struct {
	ID     int64           `json:"id"`
	Time   time.Time       `json:"time"`
	Kind   string          `json:"kind"`
	Worker string          `json:"worker,omitempty"`
	Detail json.RawMessage `json:"detail"`
}

const (
	// statusTimeout bounds the whole request: a coordinator that takes longer is as good as down.
	statusTimeout = 10 * time.Second
	// statusShownEvents is how many of the events /api/status carries are printed.
	statusShownEvents = 10
	// statusMedianSteps is how many recent steps the tokens/s median is taken over.
	statusMedianSteps = 20
	// statusDetailWidth is where an event's detail is cut.
	statusDetailWidth = 72
)

func (m *Main) runStatus(ctx context.Context, args []string) error {
	fs := m.newFlagSet("status", "[--coordinator URL] [--volunteer ID] [--json]")
	coord := fs.String("coordinator", "http://127.0.0.1:8470", "coordinator `URL` (http://host:port; the default is where 'shoal serve' listens)")
	asJSON := fs.Bool("json", false, "print the coordinator's status JSON instead of tables")
	volunteer := fs.String("volunteer", "", "also show this volunteer's total over every job: its `ID` (the identity a worker logs at start, id:…, or a worker id)")
	token := fs.String("admin-token", "", "admin `TOKEN` to send, for coordinators that require one (default $SHOAL_ADMIN_TOKEN)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *token == "" { // not the flag's default: --help would print it
		*token = os.Getenv("SHOAL_ADMIN_TOKEN")
	}
	body, now, err := fetchStatus(ctx, *coord, *token, *volunteer)
	if err != nil {
		return err
	}
	if *asJSON {
		var b bytes.Buffer
		if err := json.Indent(&b, body, "", "  "); err != nil {
			return fmt.Errorf("status from %s is not JSON: %w", *coord, err)
		}
		b.WriteByte('\n')
		_, err := m.Stdout.Write(b.Bytes())
		return err
	}
	var st statusJSON
	if err := json.Unmarshal(body, &st); err != nil {
		return fmt.Errorf("decode status from %s (is it a Shoal coordinator?): %w", *coord, err)
	}
	return writeStatus(m.Stdout, &st, now)
}

// fetchStatus gets base/api/status within statusTimeout (and ctx). It returns the body and the
// coordinator's clock from the Date header, so "last heard" ages are not skewed by this machine's
// clock; time.Now when the header is missing.
func fetchStatus(ctx context.Context, base, token, volunteer string) ([]byte, time.Time, error) {
	base = client.CoordinatorURL(base)
	endpoint := strings.TrimRight(base, "/") + "/api/status"
	if volunteer != "" {
		endpoint += "?worker=" + url.QueryEscape(volunteer)
	}
	ctx, cancel := context.WithTimeout(ctx, statusTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, endpoint, nil)
	if err != nil {
		return nil, time.Time{}, fmt.Errorf("status of coordinator %s: %w", base, err)
	}
	req.Header.Set("Accept", "application/json")
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) {
			return nil, time.Time{}, fmt.Errorf("coordinator at %s did not answer within %s", base, statusTimeout)
		}
		if ue := (*url.Error)(nil); errors.As(err, &ue) {
			err = ue.Err // it repeats the URL
		}
		return nil, time.Time{}, fmt.Errorf("coordinator at %s is unreachable: %w", base, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return nil, time.Time{}, fmt.Errorf("read status from %s: %w", endpoint, err)
	}
	switch {
	case resp.StatusCode == http.StatusUnauthorized || resp.StatusCode == http.StatusForbidden:
		return nil, time.Time{}, fmt.Errorf("GET %s: %s: pass --admin-token or set SHOAL_ADMIN_TOKEN", endpoint, resp.Status)
	case resp.StatusCode != http.StatusOK:
		msg := strings.TrimSpace(string(body))
		if len(msg) > 200 {
			msg = msg[:200] + "…"
		}
		if msg != "" {
			msg = ": " + msg
		}
		return nil, time.Time{}, fmt.Errorf("GET %s: %s%s", endpoint, resp.Status, msg)
	}
	now, err := http.ParseTime(resp.Header.Get("Date"))
	if err != nil {
		now = time.Now()
	}
	return body, now, nil
}

// writeStatus prints st as of now (the coordinator's clock): the job, the plan, the peers, the
// router load and the recent events.
func writeStatus(w io.Writer, st *statusJSON, now time.Time) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	names := peerNames(st)
	name := func(id, given string) string {
		if given != "" {
			return given
		}
		if n := names[id]; n != "" {
			return n
		}
		return "-"
	}

	if st.Job == nil {
		fmt.Fprintln(tw, "no job yet: the coordinator is idle (submit one, or start 'shoal serve --job FILE')")
	} else {
		writeJobHeader(tw, st)
	}

	if p := st.Plan; p != nil {
		fmt.Fprintf(tw, "\nplan v%d: %s, %s, %d standby; depth %d (micro-batches in flight beyond 1F1B)\n", p.Version,
			plural(len(p.Stages), "stage"), plural(len(p.ExpertHosts), "expert host"), len(p.Standby), p.Depth)
		if p.KeptFrom > 0 {
			fmt.Fprintf(tw, "  from step %d, keeping the shards of plan v%d where they were: nothing restored but what moved\n", p.FromStep+1, p.KeptFrom)
		}
		for _, t := range slices.Sorted(maps.Keys(p.TookFrom)) {
			fmt.Fprintf(tw, "  %s took its stage's state from %s: nothing restored\n", t, p.TookFrom[t])
		}
		for _, pl := range p.Pools {
			fmt.Fprintf(tw, "  pool of blocks [%d,%d): %s\n", pl.Blocks[0], pl.Blocks[1], strings.Join(pl.Members, ", "))
		}
		if p.Replicas > 1 {
			own := ""
			if p.OwnBatches {
				own = ", a batch of its own for each"
			}
			if p.Delay > 0 {
				own += ", every outer step overlapping " + plural(p.Delay, "inner step")
			}
			if p.WarmupUntil > 0 {
				own += fmt.Sprintf(" (the synchronous warm-up: outer mode from step %d)", p.WarmupUntil+1)
			}
			fmt.Fprintf(tw, "  %d pipeline replicas, %s sync%s\n", p.Replicas, p.Sync, own)
			if len(p.ReplicaSteps) > 0 {
				at := make([]string, len(p.ReplicaSteps))
				for r, s := range p.ReplicaSteps {
					at[r] = strconv.Itoa(s + 1)
				}
				fmt.Fprintf(tw, "  replicas at step %s (each at its own pace between outer steps)\n", strings.Join(at, ", "))
			}
		}
		if p.Choice != "" {
			fmt.Fprintf(tw, "  planner: %s\n", termText(p.Choice))
		}
		if len(p.Stages) > 0 && p.Replicas > 1 {
			fmt.Fprintln(tw, "  REPLICA\tMICRO-BATCHES\tSTAGE\tBLOCKS\tPEER\tNAME")
			i := 0
			for k, s := range p.Stages {
				if k > 0 && s.Replica != p.Stages[k-1].Replica {
					i = 0
				}
				fmt.Fprintf(tw, "  %d\t[%d,%d)\t%d\t[%d,%d)\t%s\t%s\n", s.Replica, s.MicroBatches[0], s.MicroBatches[1], i,
					s.Blocks[0], s.Blocks[1], s.Peer, name(s.Peer, s.PeerName))
				i++
			}
		} else if len(p.Stages) > 0 {
			fmt.Fprintln(tw, "  STAGE\tBLOCKS\tPEER\tNAME")
			for i, s := range p.Stages {
				fmt.Fprintf(tw, "  %d\t[%d,%d)\t%s\t%s\n", i, s.Blocks[0], s.Blocks[1], s.Peer, name(s.Peer, s.PeerName))
			}
		}
		if len(p.ExpertHosts) > 0 {
			tw.Flush() // align the expert hosts on their own, not under the stages' columns
			fmt.Fprintln(tw, "  EXPERT HOST\tBLOCK\tEXPERTS\tPEER\tNAME")
			for i, h := range p.ExpertHosts {
				fmt.Fprintf(tw, "  %d\t%d\t%s\t%s\t%s\n", i, h.Block, intRanges(h.Experts), h.Peer, name(h.Peer, h.PeerName))
			}
		}
		if len(p.Standby) > 0 {
			fmt.Fprintf(tw, "  standby: %s\n", strings.Join(p.Standby, " "))
		}
	} else if st.Job != nil {
		fmt.Fprintln(tw, "\nno plan yet: waiting for workers")
	}

	fmt.Fprintf(tw, "\npeers: %d connected\n", len(st.Peers))
	if len(st.Peers) > 0 {
		fmt.Fprintln(tw, "  ID\tNAME\tKIND\tBACKEND\tGFLOP/S\tLAST HEARD\tIN\tOUT")
		for _, p := range st.Peers {
			gflops := fmt.Sprintf("%.1f", p.GFLOPS)
			if p.Flagged { // claimed more than it delivered: planned with what it delivered
				gflops = fmt.Sprintf("%.1f (claimed %.1f)!", p.PlannedGFLOPS, p.GFLOPS)
			}
			backend := dash(p.Backend)
			if p.Device != "" {
				backend += " (" + termText(p.Device) + ")"
			}
			fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", p.ID, name(p.ID, p.Name), dash(p.Kind), backend,
				gflops, ago(now, p.LastHeard), humanBytes(p.BytesIn), humanBytes(p.BytesOut))
		}
	}

	if a := st.Audit; a != nil {
		fmt.Fprintf(tw, "\naudits: rate %g (every shard at least once in any %d of its steps in a row): %d recomputed, %d passed, %d failed; %.1f s of recomputation, %.0f%% of shard-steps",
			a.Rate, a.Window, a.Audits, a.Passed, a.Failed, a.RecomputeS, 100*a.ComputeShare)
		if a.Audits > 0 {
			fmt.Fprintf(tw, "; %s of evidence an audit", humanBytes(a.EvidenceBytes/a.Audits))
		}
		fmt.Fprintln(tw)
	}
	if len(st.Credits) > 0 {
		tw.Flush()
		fmt.Fprintln(tw, "\ncredit per volunteer, over its restarts and tabs (verified work only counts)")
		fmt.Fprintln(tw, "  VOLUNTEER\tLAST WORKER\tNAME\tVERIFIED MB\tGFLOP\tPENDING MB\tREJECTED MB")
		for _, c := range st.Credits {
			fmt.Fprintf(tw, "  %s\t%s\t%s\t%d\t%.1f\t%d\t%d\n", cmp.Or(c.Identity, c.Worker), c.Worker, name(c.Worker, c.Name), c.VerifiedMicroBatches, c.VerifiedGFLOP,
				c.PendingMicroBatches, c.RejectedMicroBatches)
		}
	}
	if v := st.Volunteer; v != nil {
		tw.Flush()
		fmt.Fprintf(tw, "\nvolunteer %s, over every job: %d verified micro-batches (%.1f GFLOP), %d pending, %d rejected\n",
			cmp.Or(v.Identity, v.Worker), v.VerifiedMicroBatches, v.VerifiedGFLOP, v.PendingMicroBatches, v.RejectedMicroBatches)
	}
	if len(st.Bans) > 0 {
		tw.Flush()
		fmt.Fprintln(tw, "\nbanned")
		fmt.Fprintln(tw, "  WORKER\tSTEP\tREASON")
		for _, b := range st.Bans {
			fmt.Fprintf(tw, "  %s\t%d\t%s\n", b.Worker, b.Step, b.Reason)
		}
	}

	if len(st.Router) > 0 {
		fmt.Fprintln(tw, "\nrouter, last step: tokens per expert")
		fmt.Fprintln(tw, "  BLOCK\tTOKENS\tBUSIEST")
		for _, b := range slices.Sorted(maps.Keys(st.Router)) {
			fmt.Fprintf(tw, "  %d\t%s\t%s\n", b, joinInts(st.Router[b]), busiest(st.Router[b]))
		}
	}

	if len(st.Events) > 0 {
		evs := st.Events
		if len(evs) > statusShownEvents {
			evs = evs[len(evs)-statusShownEvents:]
		}
		fmt.Fprintf(tw, "\nevents: the last %d\n", len(evs))
		fmt.Fprintln(tw, "  TIME\tKIND\tWORKER\tDETAIL")
		for _, e := range evs {
			fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\n", eventTime(now, e.Time), e.Kind, dash(e.Worker), eventDetail(e.Detail))
		}
	}
	return tw.Flush()
}

func writeJobHeader(w io.Writer, st *statusJSON) {
	j := st.Job
	fmt.Fprintf(w, "job %s  %s  step %d/%d", j.ID, j.State, j.Step, j.Steps)
	if j.Phase != "" && j.State == "running" {
		fmt.Fprintf(w, "  (%s)", j.Phase)
	}
	if len(st.Steps) == 0 {
		fmt.Fprintln(w)
	} else {
		last := st.Steps[len(st.Steps)-1]
		fmt.Fprintf(w, "  loss %.4f  aux %.4f", last.Loss, last.Aux)
		for i := len(st.Steps) - 1; i >= 0; i-- {
			if v := st.Steps[i].ValLoss; v != nil {
				fmt.Fprintf(w, "  val %.4f (step %d)", *v, st.Steps[i].Step+1)
				break
			}
		}
		recent := st.Steps[max(0, len(st.Steps)-statusMedianSteps):]
		tps := make([]float64, len(recent))
		for i, s := range recent {
			tps[i] = s.TokensPerS
		}
		fmt.Fprintf(w, "\ntokens/s %.0f last step, %.0f median of the last %s\n", last.TokensPerS, median(tps), plural(len(recent), "step"))
	}
	if j.Model != "" {
		fmt.Fprintf(w, "model %s\n", j.Model)
	}
	if j.Waiting != "" {
		fmt.Fprintf(w, "WAITING: %s\n", termText(j.Waiting))
	}
}

// peerNames gathers the names the status knows for each peer id: the peers' own, the plan's and
// the join events'.
func peerNames(st *statusJSON) map[string]string {
	names := map[string]string{}
	for _, e := range st.Events {
		if e.Kind != "worker.joined" || e.Worker == "" {
			continue
		}
		var d struct {
			Name string `json:"name"`
		}
		if json.Unmarshal(e.Detail, &d) == nil && d.Name != "" {
			names[e.Worker] = d.Name
		}
	}
	if p := st.Plan; p != nil {
		for _, s := range p.Stages {
			if s.PeerName != "" {
				names[s.Peer] = s.PeerName
			}
		}
		for _, h := range p.ExpertHosts {
			if h.PeerName != "" {
				names[h.Peer] = h.PeerName
			}
		}
	}
	for _, p := range st.Peers {
		if p.Name != "" {
			names[p.ID] = p.Name
		}
	}
	return names
}

// busiest names the expert that took the most tokens, its share of all of them, and the share
// each would have under an even split.
func busiest(tokens []int) string {
	total, top := 0, 0
	for i, n := range tokens {
		total += n
		if n > tokens[top] {
			top = i
		}
	}
	if total == 0 {
		return "-"
	}
	return fmt.Sprintf("e%d %.1f%% (even %.1f%%)", top, 100*float64(tokens[top])/float64(total), 100/float64(len(tokens)))
}

// eventDetail renders an event's JSON detail as short key=value pairs, cut at statusDetailWidth.
func eventDetail(raw json.RawMessage) string {
	var obj map[string]json.RawMessage
	var s string
	if err := json.Unmarshal(raw, &obj); err == nil {
		parts := make([]string, 0, len(obj))
		for _, k := range slices.Sorted(maps.Keys(obj)) {
			var c bytes.Buffer
			json.Compact(&c, obj[k]) // valid: it was just decoded
			v := c.String()
			var str string
			if json.Unmarshal(obj[k], &str) == nil {
				v = str
				if v == "" || strings.ContainsAny(v, " \t") {
					v = strconv.Quote(v)
				}
			}
			parts = append(parts, k+"="+v)
		}
		s = strings.Join(parts, " ")
	} else {
		s = strings.TrimSpace(string(raw))
	}
	s = strings.Join(strings.Fields(s), " ") // tabs and newlines would break the table
	if utf8.RuneCountInString(s) > statusDetailWidth {
		s = string([]rune(s)[:statusDetailWidth-1]) + "…"
	}
	if s == "" {
		return "-"
	}
	return s
}

// eventTime prints t as a clock time in the local zone, with the date when it is not today's.
func eventTime(now, t time.Time) string {
	t = t.Local()
	if y, m, d := t.Date(); now.Local().Year() != y || now.Local().Month() != m || now.Local().Day() != d {
		return t.Format("2006-01-02 15:04:05")
	}
	return t.Format("15:04:05")
}

// ago prints how long before now t was, to the second; "-" for a zero time.
func ago(now, t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	d := max(now.Sub(t), 0) // the Date header has 1 s resolution
	return d.Round(time.Second).String() + " ago"
}

// humanBytes prints n in binary units: 512 B, 1.5 KiB, 20.0 MiB.
func humanBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit && exp < 5; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

// intRanges prints a sorted list of ints compactly: 0-3,6,8-9.
func intRanges(xs []int) string {
	if len(xs) == 0 {
		return "-"
	}
	xs = slices.Sorted(slices.Values(xs))
	var parts []string
	for i := 0; i < len(xs); {
		j := i
		for j+1 < len(xs) && xs[j+1] == xs[j]+1 {
			j++
		}
		switch {
		case j == i:
			parts = append(parts, strconv.Itoa(xs[i]))
		default:
			parts = append(parts, fmt.Sprintf("%d-%d", xs[i], xs[j]))
		}
		i = j + 1
	}
	return strings.Join(parts, ",")
}

func joinInts(xs []int) string {
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = strconv.Itoa(x)
	}
	return strings.Join(s, " ")
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	sort.Float64s(s)
	if n := len(s); n%2 == 1 {
		return s[n/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// plural is "1 noun" or "n nouns" ("n micro-batches" for a noun ending in "ch").
func plural(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	if strings.HasSuffix(noun, "ch") {
		return fmt.Sprintf("%d %ses", n, noun)
	}
	return fmt.Sprintf("%d %ss", n, noun)
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
