package web

import (
	"bytes"
	"crypto/sha256"
	"embed"
	"encoding/base64"
	"fmt"
	"html/template"
	"io/fs"
	"strings"
)

// adminFiles is the dashboard: index.html, admin.js, admin.css.
//
//go:embed admin
var adminFiles embed.FS

// loginSource is the sign-in form, an html/template: it lives outside admin/ because it is shown
// to people who have not signed in, and because it is a template, not a file to serve as is.
//
//go:embed login.html
var loginSource string

var loginTemplate = template.Must(template.New("login.html").Parse(loginSource))

// Admin returns the dashboard's files with index.html at the root. The coordinator serves it,
// behind the admin check, as
//
//	http.StripPrefix("/admin", http.FileServerFS(web.Admin()))
//
// so that /admin/ is index.html and /admin/admin.js the script.
func Admin() fs.FS {
	sub, err := fs.Sub(adminFiles, "admin")
	if err != nil { // "admin" is a valid path: fs.Sub cannot fail on it
		panic(fmt.Sprintf("web: admin assets: %v", err))
	}
	return sub
}

// LoginPage renders the sign-in form for GET /admin/login. The form POSTs
// application/x-www-form-urlencoded token=... to /admin/login. errMsg, when not empty, is shown
// above the form as text (html/template escapes it); pass a fixed message of the server's own
// ("wrong token") rather than echoing a query parameter, so that a link cannot put words in the
// page's mouth. Serve it as text/html; charset=utf-8 with Cache-Control: no-store and
// Content-Security-Policy: LoginCSP().
func LoginPage(errMsg string) []byte {
	var b bytes.Buffer
	if err := loginTemplate.Execute(&b, struct{ Error string }{errMsg}); err != nil {
		// The template is fixed and the writer a buffer: only a broken template fails here,
		// and TestLoginPage catches that.
		panic(fmt.Sprintf("web: render login page: %v", err))
	}
	return b.Bytes()
}

// AdminCSP is a Content-Security-Policy the dashboard works under: its script, stylesheet and API
// calls come from its own origin only, and no other site may frame it. The page has no inline
// script or style; admin.js sets sizes through the CSSOM (element.style), which style-src does
// not restrict.
const AdminCSP = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; " +
	"img-src 'self' data:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"

// LoginCSP is the Content-Security-Policy for LoginPage: no script at all, and only the page's
// own inline stylesheet, allowed by its hash (the sign-in page cannot load /admin/admin.css,
// which is behind the sign-in).
func LoginCSP() string {
	return "default-src 'none'; style-src '" + styleHash(loginSource) + "'; img-src data:; " +
		"base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
}

// styleHash is the CSP source expression (sha256-BASE64) of the first <style> element's text in
// page, or "" when there is none.
func styleHash(page string) string {
	_, rest, ok := strings.Cut(page, "<style>")
	if !ok {
		return ""
	}
	css, _, ok := strings.Cut(rest, "</style>")
	if !ok {
		return ""
	}
	sum := sha256.Sum256([]byte(css))
	return "sha256-" + base64.StdEncoding.EncodeToString(sum[:])
}
