package main

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// pkiFiles are the paths of what writePKI made.
type pkiFiles struct {
	caCert, caKey         string
	serverCert, serverKey string
	adminCert, adminKey   string
	saKey, saPub          string
}

// writePKI makes a throwaway CA, the API server's serving certificate (127.0.0.1,
// localhost and the in-cluster names), an admin client certificate in group
// system:masters, and the service-account token signing key pair.
func writePKI(dir string) (*pkiFiles, error) {
	f := &pkiFiles{
		caCert: filepath.Join(dir, "ca.crt"), caKey: filepath.Join(dir, "ca.key"),
		serverCert: filepath.Join(dir, "apiserver.crt"), serverKey: filepath.Join(dir, "apiserver.key"),
		adminCert: filepath.Join(dir, "admin.crt"), adminKey: filepath.Join(dir, "admin.key"),
		saKey: filepath.Join(dir, "sa.key"), saPub: filepath.Join(dir, "sa.pub"),
	}
	now := time.Now()
	caKey, err := newKey()
	if err != nil {
		return nil, err
	}
	caTemplate := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "dropgate-e2e-ca"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(10 * 365 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTemplate, caTemplate, caKey.Public(), caKey)
	if err != nil {
		return nil, err
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		return nil, err
	}
	if err := writeCertAndKey(f.caCert, f.caKey, caDER, caKey); err != nil {
		return nil, err
	}

	leaf := func(serial int64, subject pkix.Name, usage x509.ExtKeyUsage, dns []string, ips []net.IP, certPath, keyPath string) error {
		key, err := newKey()
		if err != nil {
			return err
		}
		template := &x509.Certificate{
			SerialNumber: big.NewInt(serial),
			Subject:      subject,
			NotBefore:    now.Add(-time.Hour),
			NotAfter:     now.Add(365 * 24 * time.Hour),
			KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
			ExtKeyUsage:  []x509.ExtKeyUsage{usage},
			DNSNames:     dns,
			IPAddresses:  ips,
		}
		der, err := x509.CreateCertificate(rand.Reader, template, ca, key.Public(), caKey)
		if err != nil {
			return err
		}
		return writeCertAndKey(certPath, keyPath, der, key)
	}
	if err := leaf(2, pkix.Name{CommonName: "kube-apiserver"}, x509.ExtKeyUsageServerAuth,
		[]string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"},
		[]net.IP{net.IPv4(127, 0, 0, 1), net.IPv4(10, 0, 0, 1)},
		f.serverCert, f.serverKey); err != nil {
		return nil, err
	}
	if err := leaf(3, pkix.Name{CommonName: "dropgate-e2e-admin", Organization: []string{"system:masters"}},
		x509.ExtKeyUsageClientAuth, nil, nil, f.adminCert, f.adminKey); err != nil {
		return nil, err
	}

	saKey, err := newKey()
	if err != nil {
		return nil, err
	}
	if err := writeKey(f.saKey, saKey); err != nil {
		return nil, err
	}
	pub, err := x509.MarshalPKIXPublicKey(saKey.Public())
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(f.saPub, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pub}), 0o600); err != nil {
		return nil, err
	}
	return f, nil
}

func newKey() (*ecdsa.PrivateKey, error) {
	return ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
}

func writeKey(path string, key crypto.Signer) error {
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return err
	}
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), 0o600)
}

func writeCertAndKey(certPath, keyPath string, der []byte, key crypto.Signer) error {
	if err := os.WriteFile(certPath, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		return err
	}
	return writeKey(keyPath, key)
}

// writeKubeconfig writes the admin kubeconfig, everything inlined.
func writeKubeconfig(path, server string, f *pkiFiles) error {
	data := func(p string) (string, error) {
		b, err := os.ReadFile(p)
		return base64.StdEncoding.EncodeToString(b), err
	}
	ca, err := data(f.caCert)
	if err != nil {
		return err
	}
	cert, err := data(f.adminCert)
	if err != nil {
		return err
	}
	key, err := data(f.adminKey)
	if err != nil {
		return err
	}
	text := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: dropgate-e2e
  cluster:
    server: %s
    certificate-authority-data: %s
users:
- name: dropgate-e2e-admin
  user:
    client-certificate-data: %s
    client-key-data: %s
contexts:
- name: dropgate-e2e
  context:
    cluster: dropgate-e2e
    user: dropgate-e2e-admin
current-context: dropgate-e2e
`, server, ca, cert, key)
	return os.WriteFile(path, []byte(text), 0o600)
}
