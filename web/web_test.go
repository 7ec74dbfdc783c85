package web

import (
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

func readAsset(t *testing.T, name string) string {
	t.Helper()
	b, err := fs.ReadFile(Admin(), name)
	if err != nil {
		t.Fatalf("read admin asset: %v", err)
	}
	return string(b)
}

// TestAdminAssets checks that the dashboard's files are embedded and carry what the coordinator's
// browser test and the API contract depend on.
func TestAdminAssets(t *testing.T) {
	tests := []struct {
		name string
		file string
		want []string
	}{
		{"the page has every panel", "index.html", []string{
			`id="step"`, `id="loss-chart"`, `data-points=`, `id="log-steps"`, `id="map"`, `id="peers"`,
			`id="checkpoints"`, `id="events"`, `id="stage-times"`, `id="tps-spark"`,
			`id="btn-pause"`, `id="btn-resume"`, `id="btn-checkpoint"`, `id="credits"`, `id="bans"`, `id="audit"`,
		}},
		{"the page loads its script and style", "index.html", []string{`src="admin.js"`, `href="admin.css"`}},
		{"the script speaks the API", "admin.js", []string{
			"'/api/status'", "'/api/steps?from='", "new EventSource('/api/stream')", "addEventListener('status'",
			"'/api/checkpoints'", "/model'", "'X-Shoal-Action': '1'", "'/api/peers/'", "data-points",
		}},
		{"the buttons post to the job actions", "index.html", []string{
			`data-path="/api/job/pause"`, `data-path="/api/job/resume"`, `data-path="/api/checkpoint"`,
		}},
		{"the style has the palette", "admin.css", []string{"--train", "--val", "--ok", "--warn", "--bad"}},
		// coordinator.PlanStatus and StageStatus: the map draws a row per pipeline replica.
		{"the map reads the plan's replicas", "admin.js", []string{"plan.replicas", "plan.sync", "s.replica", "s.micro_batches", "'data-replica'"}},
		{"the style lays out replica rows", "admin.css", []string{".replica", ".replica-head", ".pipeline"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := readAsset(t, tt.file)
			for _, w := range tt.want {
				if !strings.Contains(got, w) {
					t.Errorf("%s lacks %q", tt.file, w)
				}
			}
		})
	}
}

// TestAdminNoInnerHTML keeps server strings out of the HTML parser: the script builds the page
// with text nodes and attributes only.
func TestAdminNoInnerHTML(t *testing.T) {
	js := readAsset(t, "admin.js")
	for _, bad := range []string{"innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"} {
		if strings.Contains(js, bad) {
			t.Errorf("admin.js uses %s", bad)
		}
	}
}

var (
	urlAttr = regexp.MustCompile(`(?i)\s(?:src|href|action|poster|data)\s*=\s*"([^"]*)"`)
	cssURL  = regexp.MustCompile(`(?i)url\(\s*['"]?([^'")]*)`)
)

// foreign reports whether u could load from another origin: it names a scheme other than data:,
// or is scheme-relative (//host/...).
func foreign(u string) bool {
	u = strings.TrimSpace(strings.ToLower(u))
	if strings.HasPrefix(u, "//") || strings.HasPrefix(u, `\\`) {
		return true
	}
	if i := strings.IndexAny(u, ":/?#"); i > 0 && u[i] == ':' {
		return !strings.HasPrefix(u, "data:")
	}
	return false
}

// TestAdminSameOrigin checks that nothing the dashboard loads comes from another origin, and
// that every relative file index.html names is embedded.
func TestAdminSameOrigin(t *testing.T) {
	page := readAsset(t, "index.html")
	refs := urlAttr.FindAllStringSubmatch(page, -1)
	if len(refs) == 0 {
		t.Fatal("index.html references nothing: the URL pattern is broken")
	}
	for _, m := range refs {
		u := m[1]
		if foreign(u) {
			t.Errorf("index.html loads %q from another origin", u)
			continue
		}
		if strings.HasPrefix(u, "data:") || strings.HasPrefix(u, "/") || strings.HasPrefix(u, "#") {
			continue
		}
		if _, err := fs.Stat(Admin(), strings.SplitN(u, "?", 2)[0]); err != nil {
			t.Errorf("index.html names %q, which is not embedded: %v", u, err)
		}
	}
	css := readAsset(t, "admin.css")
	if strings.Contains(strings.ToLower(css), "@import") {
		t.Error("admin.css imports another stylesheet")
	}
	for _, m := range cssURL.FindAllStringSubmatch(css, -1) {
		if foreign(m[1]) {
			t.Errorf("admin.css loads %q from another origin", m[1])
		}
	}
	// The script may only name paths on its own origin.
	js := readAsset(t, "admin.js")
	for _, bad := range []string{"://", "'//", `"//`, "`//"} {
		if strings.Contains(js, bad) {
			t.Errorf("admin.js contains %q: an absolute URL", bad)
		}
	}
}

func TestForeign(t *testing.T) {
	tests := []struct {
		url  string
		want bool
	}{
		{"admin.js", false},
		{"/api/status", false},
		{"data:,", false},
		{"./admin.css?v=1", false},
		{"a:b/c", true},
		{"path/with:colon", false},
		{"https://cdn.example/x.js", true},
		{"HTTP://x", true},
		{"//cdn.example/x.js", true},
		{"javascript:alert(1)", true},
	}
	for _, tt := range tests {
		if got := foreign(tt.url); got != tt.want {
			t.Errorf("foreign(%q) = %v, want %v", tt.url, got, tt.want)
		}
	}
}

var (
	tagPattern = regexp.MustCompile(`<(/?)([a-zA-Z][a-zA-Z0-9-]*)\b[^>]*>`)
	idPattern  = regexp.MustCompile(`\sid="([^"]+)"`)
	voidTags   = map[string]bool{"meta": true, "link": true, "input": true, "br": true, "hr": true, "img": true, "col": true, "wbr": true, "source": true}
)

// checkMarkup is a small well-formedness check in place of an HTML parser (the module has none):
// every non-void element is closed in order and no id is used twice.
func checkMarkup(t *testing.T, name, page string) {
	t.Helper()
	var open []string
	for _, m := range tagPattern.FindAllStringSubmatch(page, -1) {
		tag := strings.ToLower(m[2])
		switch {
		case voidTags[tag]:
		case m[1] == "":
			open = append(open, tag)
		case len(open) == 0 || open[len(open)-1] != tag:
			t.Fatalf("%s: </%s> closes %v", name, tag, open)
		default:
			open = open[:len(open)-1]
		}
	}
	if len(open) != 0 {
		t.Errorf("%s: unclosed elements %v", name, open)
	}
	seen := map[string]bool{}
	for _, m := range idPattern.FindAllStringSubmatch(page, -1) {
		if seen[m[1]] {
			t.Errorf("%s: id %q is used twice", name, m[1])
		}
		seen[m[1]] = true
	}
}

func TestMarkup(t *testing.T) {
	checkMarkup(t, "index.html", readAsset(t, "index.html"))
	checkMarkup(t, "login page", string(LoginPage("wrong token")))
}

// TestAdminScriptIDs checks that every element the script looks up by id is on the page.
func TestAdminScriptIDs(t *testing.T) {
	page, js := readAsset(t, "index.html"), readAsset(t, "admin.js")
	for _, m := range regexp.MustCompile(`\$\('([a-z0-9-]+)'\)`).FindAllStringSubmatch(js, -1) {
		if !strings.Contains(page, `id="`+m[1]+`"`) {
			t.Errorf("admin.js looks up #%s, which index.html lacks", m[1])
		}
	}
}

func TestLoginPage(t *testing.T) {
	tests := []struct {
		name    string
		msg     string
		want    []string
		notWant []string
	}{
		{
			name:    "no message",
			want:    []string{`<form method="post" action="/admin/login">`, `name="token"`, `type="password"`},
			notWant: []string{`class="error"`},
		},
		{
			name: "a message",
			msg:  "wrong token",
			want: []string{`<p class="error" role="alert">wrong token</p>`},
		},
		{
			name:    "a message is text, not markup",
			msg:     `<script>alert("x")</script>`,
			want:    []string{`&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;`},
			notWant: []string{"<script>"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := string(LoginPage(tt.msg))
			for _, w := range tt.want {
				if !strings.Contains(got, w) {
					t.Errorf("LoginPage(%q) lacks %q", tt.msg, w)
				}
			}
			for _, w := range tt.notWant {
				if strings.Contains(got, w) {
					t.Errorf("LoginPage(%q) contains %q", tt.msg, w)
				}
			}
		})
	}
}

// TestLoginCSP checks that the policy's hash allows the page's inline stylesheet as rendered:
// a stale hash would leave the form unstyled, not broken, so nothing else would notice.
func TestLoginCSP(t *testing.T) {
	csp := LoginCSP()
	h := styleHash(string(LoginPage("")))
	if h == "" {
		t.Fatal("the login page has no <style> element")
	}
	if !strings.Contains(csp, "style-src '"+h+"'") {
		t.Errorf("LoginCSP() = %q, want style-src '%s'", csp, h)
	}
	if strings.Contains(csp, "script-src") || strings.Contains(csp, "unsafe") {
		t.Errorf("LoginCSP() = %q allows more than the login page needs", csp)
	}
	if strings.Contains(AdminCSP, "unsafe") || strings.Contains(AdminCSP, "*") {
		t.Errorf("AdminCSP = %q allows inline code or any origin", AdminCSP)
	}
}

// TestAdminScriptParses compiles admin.js with Node when it is installed, so that a syntax error
// (there is no build step to catch one) fails here rather than as a blank dashboard.
func TestAdminScriptParses(t *testing.T) {
	node, err := exec.LookPath("node")
	if err != nil {
		t.Skip("node is not installed; the browser test covers the script")
	}
	f := filepath.Join(t.TempDir(), "admin.js")
	if err := os.WriteFile(f, []byte(readAsset(t, "admin.js")), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(node, "--check", f).CombinedOutput(); err != nil {
		t.Errorf("admin.js does not parse: %v\n%s", err, out)
	}
}
