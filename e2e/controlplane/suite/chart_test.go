package suite

import (
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"strings"
	"testing"
)

// helm_chart_on_real_api: what only a real API server shows about the chart (its
// rendering, lint and schemas are scripts/check-chart's): the webhook configuration
// is stored with a CA that signed the serving certificate for the webhook Service,
// `helm upgrade` keeps both (the chart looks them up), the CRD carries the keep
// policy, and a second release of the same name in another namespace installs
// beside the first and uninstalls without touching it.
func helmChartOnRealAPI(t *testing.T, e *env) {
	e.installChart(t)
	webhookConfig := operatorNS + "-" + release // "<namespace>-<fullname>": cluster-scoped
	tlsSecret := release + "-webhook-tls"

	crdMeta := e.kubectl(t, "get", "crd", "inventorydrops.dropgate.io",
		"-o", `jsonpath={.metadata.annotations.helm\.sh/resource-policy} {.metadata.labels.app\.kubernetes\.io/instance}`)
	if crdMeta != "keep "+release {
		t.Errorf("the CRD's resource-policy and instance label: %q, want %q", crdMeta, "keep "+release)
	}

	before := readWebhookTLS(t, e, webhookConfig, tlsSecret)
	before.verify(t, release+"-webhook."+operatorNS+".svc")

	// The selectors: opt-in by pod label, or namespace label with opt-out; never
	// kube-system nor the operator's namespace.
	var mwc struct {
		Webhooks []struct {
			Name              string `json:"name"`
			FailurePolicy     string `json:"failurePolicy"`
			SideEffects       string `json:"sideEffects"`
			NamespaceSelector struct {
				MatchExpressions []struct {
					Key      string   `json:"key"`
					Operator string   `json:"operator"`
					Values   []string `json:"values"`
				} `json:"matchExpressions"`
			} `json:"namespaceSelector"`
			ObjectSelector struct {
				MatchLabels map[string]string `json:"matchLabels"`
			} `json:"objectSelector"`
			ClientConfig struct {
				Service struct {
					Name, Namespace, Path string
				} `json:"service"`
			} `json:"clientConfig"`
		} `json:"webhooks"`
	}
	out := e.kubectl(t, "get", "mutatingwebhookconfiguration", webhookConfig, "-o", "json")
	if err := json.Unmarshal([]byte(out), &mwc); err != nil {
		t.Fatal(err)
	}
	if len(mwc.Webhooks) != 2 || mwc.Webhooks[0].Name != "pods.inject.dropgate.io" || mwc.Webhooks[1].Name != "namespaces.inject.dropgate.io" {
		t.Fatalf("webhooks of %s: %s", webhookConfig, out)
	}
	for _, w := range mwc.Webhooks {
		svc := w.ClientConfig.Service
		if svc.Name != release+"-webhook" || svc.Namespace != operatorNS || svc.Path != "/mutate" {
			t.Errorf("%s calls %+v, want %s-webhook in %s at /mutate", w.Name, svc, release, operatorNS)
		}
		if w.FailurePolicy != "Fail" || w.SideEffects != "None" {
			t.Errorf("%s: failurePolicy %s, sideEffects %s", w.Name, w.FailurePolicy, w.SideEffects)
		}
		excluded := ""
		for _, m := range w.NamespaceSelector.MatchExpressions {
			if m.Key == "kubernetes.io/metadata.name" && m.Operator == "NotIn" {
				excluded = strings.Join(m.Values, ",")
			}
		}
		if excluded != "kube-system,"+operatorNS {
			t.Errorf("%s excludes the namespaces %q, want kube-system,%s", w.Name, excluded, operatorNS)
		}
	}
	if got := mwc.Webhooks[0].ObjectSelector.MatchLabels; len(got) != 1 || got["dropgate.io/inject"] != "true" {
		t.Errorf("pods.inject.dropgate.io objectSelector matchLabels %v, want dropgate.io/inject=true", got)
	}

	appTeamWithEditCreatesDrops(t, e)

	// helm upgrade keeps the CA and the serving certificate.
	args := []string{"upgrade", release, e.path("charts/dropgate"), "--namespace", operatorNS, "--reuse-values"}
	e.must(t, "helm", args...)
	after := readWebhookTLS(t, e, webhookConfig, tlsSecret)
	if after.caBundle != before.caBundle || after.crt != before.crt {
		t.Errorf("helm upgrade replaced the webhook's CA or certificate")
	}
	after.verify(t, release+"-webhook."+operatorNS+".svc")

	// A second release of the same name in another namespace: no collision, then
	// uninstalled without touching the first.
	second := "e2e-second-release"
	e.must(t, "helm", "install", release, e.path("charts/dropgate"), "--namespace", second, "--create-namespace",
		"--set", "crds.install=false", "--set", "operator.replicas=0")
	t.Cleanup(func() {
		_, _ = e.run("helm", "uninstall", release, "--namespace", second)
		_, _ = e.run("kubectl", "delete", "namespace", second, "--wait=false")
	})
	e.kubectl(t, "get", "mutatingwebhookconfiguration", second+"-"+release)
	e.kubectl(t, "-n", second, "get", "deployment/"+release+"-operator", "secret/"+tlsSecret, "service/"+release+"-webhook")
	e.must(t, "helm", "uninstall", release, "--namespace", second, "--wait")
	if _, err := e.run("kubectl", "get", "mutatingwebhookconfiguration", second+"-"+release); err == nil {
		t.Errorf("helm uninstall left the second release's webhook configuration")
	}
	e.kubectl(t, "get", "mutatingwebhookconfiguration", webhookConfig)
	e.kubectl(t, "get", "crd", "inventorydrops.dropgate.io")
	e.kubectl(t, "-n", operatorNS, "get", "deployment/"+release+"-operator")
}

// appTeamWithEditCreatesDrops: the chart's ClusterRoles aggregate to the cluster's
// `edit` and `view`, so an app team bound to `edit` in its namespace creates, reads
// and deletes InventoryDrops there, and one bound to `view` reads them only.
func appTeamWithEditCreatesDrops(t *testing.T, e *env) {
	team := "e2e-team-edit"
	e.ensureNamespace(t, team)
	t.Cleanup(func() { _, _ = e.run("kubectl", "delete", "namespace", team, "--wait=false") })
	for _, role := range []string{"edit", "view"} {
		account := "dev-" + role
		e.kubectlIn(t, e.kubectl(t, "-n", team, "create", "serviceaccount", account, "--dry-run=client", "-o", "yaml"),
			"apply", "-f", "-")
		e.kubectlIn(t, e.kubectl(t, "-n", team, "create", "rolebinding", account, "--clusterrole="+role,
			"--serviceaccount="+team+":"+account, "--dry-run=client", "-o", "yaml"), "apply", "-f", "-")
	}
	as := func(role string) string { return "--as=system:serviceaccount:" + team + ":dev-" + role }
	canI := func(role, verb string) string {
		out, _ := e.run("kubectl", "auth", "can-i", verb, "inventorydrops.dropgate.io", "-n", team, as(role))
		return strings.TrimSpace(out)
	}
	// The aggregation controller fills the roles in a moment after the chart.
	e.eventually(t, "edit grants creating InventoryDrops", func() (bool, string) {
		got := canI("edit", "create")
		return got == "yes", got
	})
	drop := fmt.Sprintf("apiVersion: dropgate.io/v1alpha1\nkind: InventoryDrop\nmetadata: {name: team-sale, namespace: %s}\n"+
		"spec: {sku: X, limitedQuantity: 5, redis: {url: %q}}\n", team, e.redisURL)
	e.kubectlIn(t, drop, "apply", "-f", "-", as("edit"))
	e.kubectl(t, "-n", team, "get", "inventorydrop", "team-sale", as("view"))
	if got := canI("view", "create"); got != "no" {
		t.Errorf("view may create InventoryDrops: %q", got)
	}
	if got := canI("view", "list"); got != "yes" {
		t.Errorf("view may not list InventoryDrops: %q", got)
	}
	e.kubectl(t, "-n", team, "delete", "inventorydrop", "team-sale", "--wait=false", as("edit"))
}

type webhookTLS struct {
	caBundle, crt, caCrt string // base64, as stored
}

func readWebhookTLS(t *testing.T, e *env, webhookConfig, secret string) webhookTLS {
	t.Helper()
	bundles := strings.Fields(e.kubectl(t, "get", "mutatingwebhookconfiguration", webhookConfig,
		"-o", `jsonpath={range .webhooks[*]}{.clientConfig.caBundle}{" "}{end}`))
	if len(bundles) != 2 || bundles[0] != bundles[1] {
		t.Fatalf("%s: want one caBundle in both webhooks, got %d distinct fields", webhookConfig, len(bundles))
	}
	crt := e.jsonpath(t, operatorNS, "secret/"+secret, `{.data.tls\.crt}`)
	caCrt := e.jsonpath(t, operatorNS, "secret/"+secret, `{.data.ca\.crt}`)
	if e.jsonpath(t, operatorNS, "secret/"+secret, "{.type}") != "kubernetes.io/tls" {
		t.Errorf("secret/%s is not of type kubernetes.io/tls", secret)
	}
	return webhookTLS{caBundle: bundles[0], crt: crt, caCrt: caCrt}
}

// verify: the serving certificate chains to the webhook configuration's CA and names
// the Service's DNS name, as the API server requires; ca.crt is that CA.
func (w webhookTLS) verify(t *testing.T, dnsName string) {
	t.Helper()
	if w.caCrt != w.caBundle {
		t.Errorf("the Secret's ca.crt is not the webhook configuration's caBundle")
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(mustBase64(t, w.caBundle)) {
		t.Fatal("the caBundle holds no PEM certificate")
	}
	block, _ := pem.Decode(mustBase64(t, w.crt))
	if block == nil {
		t.Fatal("tls.crt holds no PEM certificate")
	}
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cert.Verify(x509.VerifyOptions{DNSName: dnsName, Roots: roots,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
		t.Errorf("the webhook's certificate does not verify for %s against the caBundle: %v", dnsName, err)
	}
}

func mustBase64(t *testing.T, s string) []byte {
	t.Helper()
	b, err := base64.StdEncoding.DecodeString(s)
	if err != nil {
		t.Fatal(fmt.Errorf("base64: %w", err))
	}
	return b
}
