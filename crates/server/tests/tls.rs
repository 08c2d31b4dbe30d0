//! TLS and identity (certificates and pre-shared keys) against a real server, with real
//! clients: `nbdinfo` and `nbdcopy` (libnbd over GnuTLS) with `nbds://` URIs, `qemu-img` with
//! its x509 and PSK credentials, a rustls and an OpenSSL client speaking the native protocol,
//! and the client library. Certificates are made in the test with `openssl`: a CA, the
//! server's certificate for localhost, client certificates whose common names are the
//! tenants `A` and `B`, one of another CA, and one whose purpose is server authentication
//! only; pre-shared keys are written in `psktool`'s format.
//!
//! Tenant A owns namespace 1 (export `ns1`), tenant B namespace 2 (export `ns2`). A client
//! with A's certificate reads and writes A's namespace, and is refused B's on both protocols
//! (and nothing it sent was written there).

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use std::time::Duration;

use common::{config, namespace, pattern, start};
use reflex_proto::native::{self, Opcode, RequestHeader, ResponseHeader, Status};
use reflex_server::config::{TlsConfig, TlsMode};
use reflex_server::{NbdConfig, NbdExportConfig, ServerHandle, TenantConfig};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

const NAMESPACE_BYTES: u64 = 8 << 20;

/// Runs `openssl` with `args` in `dir`; panics with its output when it fails.
fn openssl(dir: &Path, args: &[&str]) {
    let output = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("openssl (scripts/test.sh installs it): {e}"));
    assert!(
        output.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A key and a certificate signed by `ca` (the CA's files are `{ca}-cert.pem` and
/// `{ca}-key.pem`), with the extensions in `extensions`, valid for `days` (-1: it expired
/// yesterday).
fn issue(dir: &Path, name: &str, subject: &str, ca: &str, extensions: &str, days: &str) {
    let key = format!("{name}-key.pem");
    let csr = format!("{name}.csr");
    let ext = format!("{name}.ext");
    std::fs::write(dir.join(&ext), extensions).unwrap();
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            subject,
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &format!("{ca}-cert.pem"),
            "-CAkey",
            &format!("{ca}-key.pem"),
            "-CAcreateserial",
            "-days",
            days,
            "-out",
            &format!("{name}-cert.pem"),
            "-extfile",
            &ext,
        ],
    );
}

fn self_signed_ca(dir: &Path, name: &str, subject: &str) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &format!("{name}-key.pem"),
            "-out",
            &format!("{name}-cert.pem"),
            "-days",
            "2",
            "-subj",
            subject,
        ],
    );
}

const CLIENT_EXTENSIONS: &str = "extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\n";

/// The test's certificates, and a libnbd certificate folder per client identity
/// (`ca-cert.pem`, `client-cert.pem`, `client-key.pem`, as GnuTLS clients expect).
struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn new() -> Pki {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path();
        self_signed_ca(path, "ca", "/CN=ReFlex test CA");
        self_signed_ca(path, "rogue-ca", "/CN=Someone else");
        issue(
            path,
            "server",
            "/CN=localhost",
            "ca",
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n",
            "2",
        );
        issue(path, "A", "/CN=A", "ca", CLIENT_EXTENSIONS, "2");
        issue(path, "B", "/CN=B", "ca", CLIENT_EXTENSIONS, "2");
        issue(path, "rogue", "/CN=A", "rogue-ca", CLIENT_EXTENSIONS, "2");
        issue(path, "expired", "/CN=A", "ca", CLIENT_EXTENSIONS, "-1");
        issue(
            path,
            "wrong-purpose",
            "/CN=A",
            "ca",
            "extendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n",
            "2",
        );
        for client in ["A", "B", "rogue", "expired", "wrong-purpose"] {
            let folder = path.join(format!("nbd-{client}"));
            std::fs::create_dir(&folder).unwrap();
            std::fs::copy(path.join("ca-cert.pem"), folder.join("ca-cert.pem")).unwrap();
            std::fs::copy(
                path.join(format!("{client}-cert.pem")),
                folder.join("client-cert.pem"),
            )
            .unwrap();
            std::fs::copy(
                path.join(format!("{client}-key.pem")),
                folder.join("client-key.pem"),
            )
            .unwrap();
        }
        Pki { dir }
    }

    fn file(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }

    fn nbd_folder(&self, client: &str) -> PathBuf {
        self.dir.path().join(format!("nbd-{client}"))
    }
}

/// Tenants A and B, each with its namespace and NBD export; TLS required on the native and
/// NBD listeners, client certificates from the test CA.
fn tls_server(pki: &Pki) -> ServerHandle {
    start(tls_config(pki))
}

/// [`tls_server`]'s configuration.
fn tls_config(pki: &Pki) -> reflex_server::Config {
    let mut ns1 = namespace(1, "mem", Some(NAMESPACE_BYTES));
    ns1.tenant = Some("A".to_string());
    // Namespace 2 has QoS (its tenants live in the control plane); namespace 1 has none
    // (the configuration's bindings decide): both ways of finding a certificate's tenant.
    let mut ns2 = namespace(2, "mem", Some(NAMESPACE_BYTES));
    ns2.tenant = Some("B".to_string());
    ns2.profile = Some(format!(
        "{}/../../profiles/device-a-small.toml",
        env!("CARGO_MANIFEST_DIR")
    ));
    let mut config = config(vec![ns1, ns2]);
    config.original_ports = Some(Vec::new());
    config.nvme_tcp.enabled = false;
    config.tenants = vec![
        TenantConfig::best_effort("A"),
        TenantConfig::best_effort("B"),
    ];
    config.nbd = NbdConfig {
        port: 0,
        exports: Vec::<NbdExportConfig>::new(),
        ..NbdConfig::default()
    };
    config.tls = TlsConfig {
        certificate: Some(pki.file("server-cert.pem")),
        key: Some(pki.file("server-key.pem")),
        client_ca: Some(pki.file("ca-cert.pem")),
        native: TlsMode::Require,
        nbd: TlsMode::Require,
        nbd_tls_only_exports: Vec::new(),
        psk_file: None,
    };
    config
}

fn nbd_uri(server: &ServerHandle, export: &str, pki: &Pki, client: &str) -> String {
    let port = server.nbd_addr().expect("NBD listens").port();
    format!(
        "nbds://localhost:{port}/{export}?tls-certificates={}",
        pki.nbd_folder(client).display()
    )
}

fn run(program: &str, args: &[&str]) -> Output {
    Command::new("timeout")
        .arg("60")
        .arg(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program} (scripts/test.sh installs libnbd-bin): {e}"))
}

fn nbdcopy(from: &str, to: &str) -> Output {
    run("nbdcopy", &["--connections=2", "--requests=16", from, to])
}

/// `qemu-img convert` of the raw file `input` onto the NBD `target` (image options), with
/// the TLS credentials `object` (`--object`).
fn qemu_img_write(object: &str, target: &str, input: &Path) -> Output {
    run(
        "qemu-img",
        &[
            "convert",
            "-n",
            "--object",
            object,
            "-f",
            "raw",
            input.to_str().unwrap(),
            "--target-image-opts",
            target,
        ],
    )
}

#[test]
fn nbd_over_tls_copies_data_exactly_with_a_client_certificate() {
    let pki = Pki::new();
    let server = tls_server(&pki);
    let work = tempfile::tempdir().unwrap();
    let input = work.path().join("in.bin");
    let output = work.path().join("out.bin");
    let data = pattern(7, NAMESPACE_BYTES as usize);
    std::fs::write(&input, &data).unwrap();
    let uri = nbd_uri(&server, "ns1", &pki, "A");

    let info = run("nbdinfo", &[&uri]);
    let info_text = String::from_utf8_lossy(&info.stdout);
    assert!(info.status.success(), "nbdinfo: {info:?}");
    assert!(info_text.contains("with TLS"), "{info_text}");

    let copy_in = nbdcopy(input.to_str().unwrap(), &uri);
    assert!(copy_in.status.success(), "nbdcopy in: {copy_in:?}");
    let copy_out = nbdcopy(&uri, output.to_str().unwrap());
    assert!(copy_out.status.success(), "nbdcopy out: {copy_out:?}");
    assert!(
        std::fs::read(&output).unwrap() == data,
        "data read back differs"
    );

    // qemu-img with its own TLS options (x509 credentials from the same folder).
    let port = server.nbd_addr().unwrap().port();
    let object = format!(
        "tls-creds-x509,id=tls0,dir={},endpoint=client",
        pki.nbd_folder("A").display()
    );
    let target = format!("driver=nbd,host=localhost,port={port},export=ns1,tls-creds=tls0");
    let other = pattern(8, NAMESPACE_BYTES as usize);
    std::fs::write(&input, &other).unwrap();
    let write = qemu_img_write(&object, &target, &input);
    assert!(write.status.success(), "qemu-img write: {write:?}");
    let read = run(
        "qemu-img",
        &[
            "convert",
            "--object",
            &object,
            "--image-opts",
            &target,
            "-O",
            "raw",
            output.to_str().unwrap(),
        ],
    );
    assert!(read.status.success(), "qemu-img read: {read:?}");
    assert!(
        std::fs::read(&output).unwrap() == other,
        "qemu-img read back differs"
    );
}

#[test]
fn nbd_refuses_plaintext_and_bad_certificates_and_keeps_serving() {
    let pki = Pki::new();
    let server = tls_server(&pki);
    let port = server.nbd_addr().unwrap().port();
    // Plaintext on a TLS-required server: every option but STARTTLS is refused.
    let plain = run("nbdinfo", &[&format!("nbd://localhost:{port}/ns1")]);
    assert!(!plain.status.success(), "plaintext NBD was served");
    // A certificate of another CA, an expired one, and one not meant for clients.
    for client in ["rogue", "expired", "wrong-purpose"] {
        let refused = run("nbdinfo", &[&nbd_uri(&server, "ns1", &pki, client)]);
        assert!(
            !refused.status.success(),
            "{client} certificate was accepted: {refused:?}"
        );
    }
    // A handshake cut in the middle, and TLS garbage after STARTTLS.
    let addr = server.nbd_addr().unwrap();
    for tail in [&[0x16, 0x03, 0x01, 0x02][..], &[0xff; 64][..]] {
        let mut stream = TcpStream::connect(addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let mut greeting = [0u8; 18];
        stream.read_exact(&mut greeting).unwrap();
        let mut starttls = 1u32.to_be_bytes().to_vec(); // FIXED_NEWSTYLE
        starttls.extend_from_slice(b"IHAVEOPT");
        starttls.extend_from_slice(&5u32.to_be_bytes());
        starttls.extend_from_slice(&0u32.to_be_bytes());
        stream.write_all(&starttls).unwrap();
        let mut reply = [0u8; 20];
        stream.read_exact(&mut reply).unwrap();
        assert_eq!(
            &reply[12..16],
            &1u32.to_be_bytes(),
            "STARTTLS is acknowledged"
        );
        stream.write_all(tail).unwrap();
        drop(stream);
    }
    // Still serving.
    let info = run("nbdinfo", &[&nbd_uri(&server, "ns1", &pki, "A")]);
    assert!(
        info.status.success(),
        "nbdinfo after the bad clients: {info:?}"
    );
}

#[test]
fn nbd_client_of_tenant_a_cannot_touch_tenant_b() {
    let pki = Pki::new();
    let server = tls_server(&pki);
    let work = tempfile::tempdir().unwrap();
    let b_data = pattern(11, NAMESPACE_BYTES as usize);
    let b_file = work.path().join("b.bin");
    std::fs::write(&b_file, &b_data).unwrap();
    let copy = nbdcopy(
        b_file.to_str().unwrap(),
        &nbd_uri(&server, "ns2", &pki, "B"),
    );
    assert!(copy.status.success(), "B writes its own export: {copy:?}");

    let a_file = work.path().join("a.bin");
    std::fs::write(&a_file, pattern(12, NAMESPACE_BYTES as usize)).unwrap();
    let write = nbdcopy(
        a_file.to_str().unwrap(),
        &nbd_uri(&server, "ns2", &pki, "A"),
    );
    assert!(!write.status.success(), "A wrote B's export");
    let read = nbdcopy(
        &nbd_uri(&server, "ns2", &pki, "A"),
        work.path().join("stolen.bin").to_str().unwrap(),
    );
    assert!(!read.status.success(), "A read B's export");

    let check = work.path().join("check.bin");
    let copy = nbdcopy(&nbd_uri(&server, "ns2", &pki, "B"), check.to_str().unwrap());
    assert!(copy.status.success(), "B reads its own export: {copy:?}");
    assert!(std::fs::read(&check).unwrap() == b_data, "B's data changed");
}

/// A native-protocol client over rustls, presenting `client`'s certificate.
fn native_tls(
    addr: SocketAddr,
    pki: &Pki,
    client: &str,
) -> rustls::StreamOwned<rustls::ClientConnection, TcpStream> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(pki.file("ca-cert.pem")).unwrap())
        .unwrap();
    let chain =
        vec![CertificateDer::from_pem_file(pki.file(&format!("{client}-cert.pem"))).unwrap()];
    let key = PrivateKeyDer::from_pem_file(pki.file(&format!("{client}-key.pem"))).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .unwrap();
    let name = ServerName::try_from("localhost").unwrap();
    let connection = rustls::ClientConnection::new(Arc::new(config), name).unwrap();
    let stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    rustls::StreamOwned::new(connection, stream)
}

fn call(
    stream: &mut impl ReadWrite,
    header: &RequestHeader,
    payload: &[u8],
) -> (ResponseHeader, Vec<u8>) {
    let mut bytes = header.to_bytes().to_vec();
    bytes.extend_from_slice(payload);
    stream.write_all(&bytes).unwrap();
    stream.flush().unwrap();
    let mut response = [0u8; native::RESPONSE_HEADER_SIZE];
    stream.read_exact(&mut response).unwrap();
    let Ok(Some((response, _))) = ResponseHeader::decode(&response) else {
        panic!("malformed response");
    };
    let mut body = vec![0u8; response.length_bytes as usize];
    stream.read_exact(&mut body).unwrap();
    assert_eq!(response.request_id, header.request_id);
    (response, body)
}

trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

#[test]
fn native_tls_identity_chooses_the_tenant_and_refuses_the_others() {
    let pki = Pki::new();
    let server = tls_server(&pki);
    let mut a = native_tls(server.native_addr(), &pki, "A");
    let block = pattern(21, 4096);
    // A's namespace: write, then read back.
    let (answer, _) = call(
        &mut a,
        &RequestHeader::write(1, 1, 8192, 4096, false),
        &block,
    );
    assert_eq!(answer.status(), Ok(Status::Ok));
    let (answer, data) = call(&mut a, &RequestHeader::read(2, 1, 8192, 4096), &[]);
    assert_eq!(answer.status(), Ok(Status::Ok));
    assert_eq!(data, block);
    // B's namespace: refused both ways.
    let (answer, _) = call(
        &mut a,
        &RequestHeader::write(3, 2, 8192, 4096, false),
        &block,
    );
    assert_eq!(answer.status(), Ok(Status::Permission));
    let (answer, _) = call(&mut a, &RequestHeader::read(4, 2, 8192, 4096), &[]);
    assert_eq!(answer.status(), Ok(Status::Permission));
    // BIND to B's tenant, even knowing its handle: refused.
    let b_handle = server.tenant_handle(2, "B").expect("tenant B");
    let bind = RequestHeader {
        length_bytes: 8,
        ..RequestHeader::new(Opcode::Bind, 5)
    };
    let (answer, _) = call(&mut a, &bind, &b_handle.to_le_bytes());
    assert_eq!(answer.status(), Ok(Status::Permission));
    // B sees its namespace unchanged: A's refused write left nothing.
    let mut b = native_tls(server.native_addr(), &pki, "B");
    let (answer, data) = call(&mut b, &RequestHeader::read(6, 2, 8192, 4096), &[]);
    assert_eq!(answer.status(), Ok(Status::Ok));
    assert!(
        data.iter().all(|&byte| byte == 0),
        "A's refused write landed"
    );
    let stats = server.tenant(b_handle).expect("tenant B");
    let _ = stats;
}

#[test]
fn native_tls_port_closes_plaintext_and_bad_certificates() {
    let pki = Pki::new();
    let server = tls_server(&pki);
    // Plaintext: the server reads it as a broken TLS record and closes.
    let mut plain = TcpStream::connect(server.native_addr()).unwrap();
    plain
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    plain
        .write_all(&RequestHeader::read(1, 1, 0, 4096).to_bytes())
        .unwrap();
    let mut bytes = Vec::new();
    let _ = plain.read_to_end(&mut bytes);
    assert!(
        bytes.len() < native::RESPONSE_HEADER_SIZE || bytes[0] == 0x15,
        "plaintext got an answer: {bytes:?}"
    );
    // Another CA's certificate: the handshake fails, nothing is answered.
    let mut rogue = native_tls(server.native_addr(), &pki, "rogue");
    let mut response = [0u8; native::RESPONSE_HEADER_SIZE];
    let sent = rogue
        .write_all(&RequestHeader::read(1, 1, 0, 4096).to_bytes())
        .and_then(|()| rogue.flush())
        .and_then(|()| rogue.read_exact(&mut response));
    assert!(sent.is_err(), "a rogue certificate was served");
    // Still serving.
    let mut a = native_tls(server.native_addr(), &pki, "A");
    let (answer, _) = call(&mut a, &RequestHeader::read(2, 1, 0, 4096), &[]);
    assert_eq!(answer.status(), Ok(Status::Ok));
}

#[test]
fn sighup_reloads_the_certificate_for_new_sessions() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path();
    let server_extensions =
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n";
    for ca in ["old", "new"] {
        self_signed_ca(path, &format!("{ca}-ca"), &format!("/CN={ca} CA"));
        issue(
            path,
            ca,
            "/CN=localhost",
            &format!("{ca}-ca"),
            server_extensions,
            "2",
        );
        let folder = path.join(format!("trusts-{ca}"));
        std::fs::create_dir(&folder).unwrap();
        std::fs::copy(
            path.join(format!("{ca}-ca-cert.pem")),
            folder.join("ca-cert.pem"),
        )
        .unwrap();
    }
    std::fs::copy(path.join("old-cert.pem"), path.join("server-cert.pem")).unwrap();
    std::fs::copy(path.join("old-key.pem"), path.join("server-key.pem")).unwrap();
    let config = path.join("reflexd.toml");
    std::fs::write(
        &config,
        "port = 0\noriginal_ports = []\narena_bytes_per_thread = \"4M\"\n\
         [nbd]\nport = 0\n[nvme_tcp]\nenabled = false\n\
         [[namespace]]\nid = 1\nbackend = \"mem:4M\"\n\
         [tls]\ncertificate = \"server-cert.pem\"\nkey = \"server-key.pem\"\nnbd = \"require\"\n",
    )
    .unwrap();
    let (mut child, lines) = common::spawn_reflexd(&config, false);
    let serving = common::wait_for_line(&lines, "reflexd serving");
    let nbd: SocketAddr = common::log_field(&serving, "nbd").expect("NBD address");
    let uri = |ca: &str| {
        format!(
            "nbds://localhost:{}/ns1?tls-certificates={}",
            nbd.port(),
            path.join(format!("trusts-{ca}")).display()
        )
    };
    assert!(run("nbdinfo", &[&uri("old")]).status.success());
    assert!(!run("nbdinfo", &[&uri("new")]).status.success());

    std::fs::copy(path.join("new-cert.pem"), path.join("server-cert.pem")).unwrap();
    std::fs::copy(path.join("new-key.pem"), path.join("server-key.pem")).unwrap();
    let status = Command::new("kill")
        .arg("-HUP")
        .arg(child.id().to_string())
        .status()
        .unwrap();
    assert!(status.success());
    common::wait_for_line(&lines, "TLS certificates reloaded");
    assert!(run("nbdinfo", &[&uri("new")]).status.success());
    assert!(!run("nbdinfo", &[&uri("old")]).status.success());

    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn a_tls_client_on_a_plaintext_port_is_refused_and_others_are_served() {
    let pki = Pki::new();
    let server = common::mem_server();
    let mut tls = native_tls(server.native_addr(), &pki, "A");
    let mut response = [0u8; native::RESPONSE_HEADER_SIZE];
    let sent = tls
        .write_all(&RequestHeader::read(1, 1, 0, 4096).to_bytes())
        .and_then(|()| tls.flush())
        .and_then(|()| tls.read_exact(&mut response));
    assert!(sent.is_err(), "a TLS handshake got an answer");
    let mut plain = TcpStream::connect(server.native_addr()).unwrap();
    plain
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let (answer, _) = call(&mut plain, &RequestHeader::read(2, 1, 0, 4096), &[]);
    assert_eq!(answer.status(), Ok(Status::Ok));
}

/// Sends `bytes` (pipelined requests) while reading answers, without blocking either way,
/// until `count` answers came; returns them (header and body) in arrival order.
fn pipeline(
    stream: &mut rustls::StreamOwned<rustls::ClientConnection, TcpStream>,
    bytes: &[u8],
    count: usize,
) -> Vec<(ResponseHeader, Vec<u8>)> {
    stream.sock.set_nonblocking(true).unwrap();
    let mut answers = Vec::new();
    let mut sent = 0;
    let mut pending = Vec::new();
    let mut buffer = vec![0u8; 64 * 1024];
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while answers.len() < count {
        assert!(
            std::time::Instant::now() < deadline,
            "answers stopped coming"
        );
        let mut progress = false;
        if sent < bytes.len() {
            let end = (sent + 64 * 1024).min(bytes.len());
            match stream.write(&bytes[sent..end]) {
                Ok(n) => {
                    sent += n;
                    progress = n > 0;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => panic!("send: {e}"),
            }
        }
        match stream.flush() {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => panic!("flush: {e}"),
        }
        match stream.read(&mut buffer) {
            Ok(0) => panic!("the server closed the connection"),
            Ok(n) => {
                pending.extend_from_slice(&buffer[..n]);
                progress = true;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => panic!("receive: {e}"),
        }
        while let Ok(Some((header, _))) = ResponseHeader::decode(&pending) {
            let total = native::RESPONSE_HEADER_SIZE + header.length_bytes as usize;
            if pending.len() < total {
                break;
            }
            answers.push((
                header,
                pending[native::RESPONSE_HEADER_SIZE..total].to_vec(),
            ));
            pending.drain(..total);
        }
        if !progress {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    stream.sock.set_nonblocking(false).unwrap();
    answers
}

#[test]
fn native_tls_pipelined_large_requests_come_back_exact() {
    let pki = Pki::new();
    let server = tls_server(&pki);
    let mut a = native_tls(server.native_addr(), &pki, "A");
    const CHUNK: usize = 256 * 1024;
    let chunks = NAMESPACE_BYTES as usize / CHUNK;
    let data = pattern(31, NAMESPACE_BYTES as usize);
    // Every request is sent before its answer is read: the server's sends and receives stall
    // on full socket buffers and resume in pieces of TLS records.
    let mut writes = Vec::new();
    for (i, chunk) in data.chunks(CHUNK).enumerate() {
        let offset = (i * CHUNK) as u64;
        writes.extend_from_slice(
            &RequestHeader::write(i as u64, 1, offset, CHUNK as u32, false).to_bytes(),
        );
        writes.extend_from_slice(chunk);
    }
    for (header, _) in pipeline(&mut a, &writes, chunks) {
        assert_eq!(
            header.status(),
            Ok(Status::Ok),
            "write {}",
            header.request_id
        );
    }
    let mut reads = Vec::new();
    for i in 0..chunks {
        let offset = (i * CHUNK) as u64;
        reads.extend_from_slice(&RequestHeader::read(i as u64, 1, offset, CHUNK as u32).to_bytes());
    }
    let mut read_back = vec![0u8; data.len()];
    for (header, body) in pipeline(&mut a, &reads, chunks) {
        assert_eq!(
            header.status(),
            Ok(Status::Ok),
            "read {}",
            header.request_id
        );
        let offset = header.request_id as usize * CHUNK;
        read_back[offset..offset + CHUNK].copy_from_slice(&body);
    }
    assert!(read_back == data, "data read back differs");
}

#[test]
fn the_client_library_speaks_tls_with_its_certificate() {
    use reflex_client::{Client, ClientError, ClientOptions, TlsOptions};
    let pki = Pki::new();
    let server = tls_server(&pki);
    let tls = TlsOptions::from_pem_files(
        Path::new(&pki.file("ca-cert.pem")),
        Some((
            Path::new(&pki.file("A-cert.pem")),
            Path::new(&pki.file("A-key.pem")),
        )),
        "localhost",
    )
    .unwrap();
    let options = ClientOptions {
        tls: Some(tls),
        ..ClientOptions::default()
    };
    let mut client = Client::connect_with(server.native_addr(), &options).unwrap();
    let block = pattern(41, 64 * 1024);
    client.write(1, 0, &block).unwrap();
    let mut back = vec![0u8; block.len()];
    client.read(1, 0, &mut back).unwrap();
    assert_eq!(back, block);
    match client.read(2, 0, &mut back) {
        Err(ClientError::Status { status, .. }) => assert_eq!(status, Status::Permission),
        other => panic!("tenant A read tenant B's namespace: {other:?}"),
    }
    // Without TLS options, the TLS port does not serve the library.
    assert!(Client::connect_with(server.native_addr(), &ClientOptions::default()).is_err());
}

#[test]
fn a_tls_only_export_is_refused_in_plaintext_beside_one_that_is_not() {
    let pki = Pki::new();
    let mut config = tls_config(&pki);
    config.tls.nbd = TlsMode::Optional;
    config.tls.nbd_tls_only_exports = vec!["ns2".to_string()];
    let server = start(config);
    let port = server.nbd_addr().unwrap().port();
    let plain = |export: &str| run("nbdinfo", &[&format!("nbd://localhost:{port}/{export}")]);
    assert!(plain("ns1").status.success(), "ns1 is served in plaintext");
    let refused = plain("ns2");
    assert!(!refused.status.success(), "ns2 was served in plaintext");
    let listed = run("nbdinfo", &["--list", &format!("nbd://localhost:{port}")]);
    let listed = String::from_utf8_lossy(&listed.stdout);
    assert!(
        listed.contains("ns1") && !listed.contains("ns2"),
        "{listed}"
    );
    let over_tls = run("nbdinfo", &[&nbd_uri(&server, "ns2", &pki, "B")]);
    assert!(over_tls.status.success(), "ns2 over TLS: {over_tls:?}");
}

/// A `psktool`-format key file: one `identity:hexkey` line per entry.
fn psk_file(dir: &Path, name: &str, entries: &[(&str, &str)]) -> String {
    let path = dir.join(name);
    let text: String = entries
        .iter()
        .map(|(identity, key)| format!("{identity}:{key}\n"))
        .collect();
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

const KEY_A: &str = "0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9";
const KEY_B: &str = "f9e8d7c6b5a4938271605f4e3d2c1b0af9e8d7c6b5a4938271605f4e3d2c1b0a";

/// [`tls_config`] with pre-shared keys for A and B beside the certificates.
fn psk_server(pki: &Pki) -> ServerHandle {
    let mut config = tls_config(pki);
    config.tls.psk_file = Some(psk_file(
        pki.dir.path(),
        "server.psk",
        &[("A", KEY_A), ("B", KEY_B)],
    ));
    start(config)
}

/// An `nbds://` URI for `identity` with the key file `keys`.
fn psk_uri(server: &ServerHandle, export: &str, identity: &str, keys: &str) -> String {
    let port = server.nbd_addr().expect("NBD listens").port();
    format!("nbds://{identity}@localhost:{port}/{export}?tls-psk-file={keys}")
}

#[test]
fn nbd_over_tls_with_a_psk_file_copies_data_exactly_and_names_the_tenant() {
    let pki = Pki::new();
    let server = psk_server(&pki);
    let dir = pki.dir.path();
    let a_keys = psk_file(dir, "a.psk", &[("A", KEY_A)]);
    let work = tempfile::tempdir().unwrap();
    let data = pattern(31, NAMESPACE_BYTES as usize);
    let input = work.path().join("in.bin");
    std::fs::write(&input, &data).unwrap();
    let uri = psk_uri(&server, "ns1", "A", &a_keys);
    let info = run("nbdinfo", &[&uri]);
    assert!(info.status.success(), "nbdinfo with A's key: {info:?}");
    let copy_in = nbdcopy(input.to_str().unwrap(), &uri);
    assert!(copy_in.status.success(), "nbdcopy in: {copy_in:?}");
    let output = work.path().join("out.bin");
    let copy_out = nbdcopy(&uri, output.to_str().unwrap());
    assert!(copy_out.status.success(), "nbdcopy out: {copy_out:?}");
    assert!(std::fs::read(&output).unwrap() == data, "data differs");

    // The identity is the tenant: A's key does not open B's export, either way.
    let stolen = work.path().join("stolen.bin");
    let read = nbdcopy(
        &psk_uri(&server, "ns2", "A", &a_keys),
        stolen.to_str().unwrap(),
    );
    assert!(!read.status.success(), "A's key read B's export");
    let write = nbdcopy(
        input.to_str().unwrap(),
        &psk_uri(&server, "ns2", "A", &a_keys),
    );
    assert!(!write.status.success(), "A's key wrote B's export");
    let b_keys = psk_file(dir, "b.psk", &[("B", KEY_B)]);
    let check = work.path().join("check.bin");
    let copy = nbdcopy(
        &psk_uri(&server, "ns2", "B", &b_keys),
        check.to_str().unwrap(),
    );
    assert!(copy.status.success(), "B reads its own export: {copy:?}");
    assert!(
        std::fs::read(&check).unwrap().iter().all(|&byte| byte == 0),
        "A's refused write landed in B's export"
    );
    // qemu-img with its own PSK credentials (`keys.psk` in a folder, the user name).
    let qemu_dir = dir.join("qemu-psk");
    std::fs::create_dir(&qemu_dir).unwrap();
    psk_file(&qemu_dir, "keys.psk", &[("A", KEY_A)]);
    let port = server.nbd_addr().unwrap().port();
    let object = format!(
        "tls-creds-psk,id=tls0,dir={},username=A,endpoint=client",
        qemu_dir.display()
    );
    let target = format!("driver=nbd,host=localhost,port={port},export=ns1,tls-creds=tls0");
    let other = pattern(32, NAMESPACE_BYTES as usize);
    std::fs::write(&input, &other).unwrap();
    let write = qemu_img_write(&object, &target, &input);
    assert!(write.status.success(), "qemu-img write with PSK: {write:?}");
    let copy_out = nbdcopy(&uri, output.to_str().unwrap());
    assert!(copy_out.status.success(), "nbdcopy out: {copy_out:?}");
    assert!(
        std::fs::read(&output).unwrap() == other,
        "qemu-img's write read back differs"
    );
    // Certificates still work on the same listener.
    let info = run("nbdinfo", &[&nbd_uri(&server, "ns1", &pki, "A")]);
    assert!(info.status.success(), "a certificate beside PSK: {info:?}");
}

#[test]
fn a_wrong_key_or_an_unknown_identity_is_refused_and_others_are_served() {
    let pki = Pki::new();
    let server = psk_server(&pki);
    let dir = pki.dir.path();
    let wrong = psk_file(dir, "wrong.psk", &[("A", KEY_B)]);
    let refused = run("nbdinfo", &[&psk_uri(&server, "ns1", "A", &wrong)]);
    assert!(!refused.status.success(), "a wrong key was accepted");
    let unknown = psk_file(dir, "unknown.psk", &[("C", KEY_A)]);
    let refused = run("nbdinfo", &[&psk_uri(&server, "ns1", "C", &unknown)]);
    assert!(
        !refused.status.success(),
        "an unknown identity was accepted"
    );
    // The native port: a wrong key fails the PSK handshake; an unknown identity is an
    // ordinary certificate handshake (rustls), which this server's client CA refuses.
    for (identity, key) in [("C", KEY_A), ("A", KEY_B)] {
        let stream = TcpStream::connect(server.native_addr()).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let served = ssl_connect(psk_connector(identity, key), stream).is_ok_and(|mut session| {
            let mut response = [0u8; native::RESPONSE_HEADER_SIZE];
            session
                .write_all(&RequestHeader::read(1, 1, 0, 4096).to_bytes())
                .and_then(|()| session.read_exact(&mut response))
                .is_ok()
        });
        assert!(!served, "{identity} with a wrong key was served");
    }
    let a_keys = psk_file(dir, "a.psk", &[("A", KEY_A)]);
    let info = run("nbdinfo", &[&psk_uri(&server, "ns1", "A", &a_keys)]);
    assert!(info.status.success(), "A after the refusals: {info:?}");
}

/// An OpenSSL client configuration offering `identity`'s pre-shared `key` (hex), TLS 1.3.
fn psk_connector(identity: &'static str, key: &'static str) -> openssl::ssl::ConnectConfiguration {
    use openssl::ssl::{SslConnector, SslMethod, SslVerifyMode, SslVersion};
    let mut builder = SslConnector::builder(SslMethod::tls_client()).unwrap();
    builder
        .set_min_proto_version(Some(SslVersion::TLS1_3))
        .unwrap();
    builder.set_verify(SslVerifyMode::NONE);
    builder.set_psk_client_callback(move |_, _hint, identity_out, key_out| {
        let key: Vec<u8> = (0..key.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&key[i..i + 2], 16).unwrap())
            .collect();
        identity_out[..identity.len()].copy_from_slice(identity.as_bytes());
        identity_out[identity.len()] = 0;
        key_out[..key.len()].copy_from_slice(&key);
        Ok(key.len())
    });
    let mut configuration = builder.build().configure().unwrap();
    configuration.set_verify_hostname(false);
    configuration
}

/// A native-protocol client over OpenSSL with a pre-shared key.
fn native_psk(
    addr: SocketAddr,
    identity: &'static str,
    key: &'static str,
) -> openssl::ssl::SslStream<TcpStream> {
    let stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    ssl_connect(psk_connector(identity, key), stream).expect("PSK handshake")
}

/// An OpenSSL client handshake that goes on after an interrupted system call: a blocking
/// socket with a read timeout fails with EINTR when the process is stopped and resumed
/// (signal(7)), which a busy CI machine does; std's `read_exact` retries, OpenSSL's
/// handshake does not.
fn ssl_connect(
    configuration: openssl::ssl::ConnectConfiguration,
    stream: TcpStream,
) -> Result<openssl::ssl::SslStream<TcpStream>, openssl::ssl::HandshakeError<TcpStream>> {
    use openssl::ssl::HandshakeError;
    let mut attempt = configuration.connect("localhost", stream);
    loop {
        match attempt {
            Err(HandshakeError::Failure(mid))
                if mid
                    .error()
                    .io_error()
                    .is_some_and(|e| e.kind() == std::io::ErrorKind::Interrupted) =>
            {
                attempt = mid.handshake();
            }
            other => return other,
        }
    }
}

#[test]
fn native_psk_identity_chooses_the_tenant() {
    let pki = Pki::new();
    let server = psk_server(&pki);
    let mut a = native_psk(server.native_addr(), "A", KEY_A);
    let block = pattern(41, 4096);
    let (answer, _) = call(
        &mut a,
        &RequestHeader::write(1, 1, 4096, 4096, false),
        &block,
    );
    assert_eq!(answer.status(), Ok(Status::Ok));
    let (answer, data) = call(&mut a, &RequestHeader::read(2, 1, 4096, 4096), &[]);
    assert_eq!(answer.status(), Ok(Status::Ok));
    assert_eq!(data, block);
    let (answer, _) = call(
        &mut a,
        &RequestHeader::write(3, 2, 4096, 4096, false),
        &block,
    );
    assert_eq!(answer.status(), Ok(Status::Permission));
    // A 1 MiB read comes back exact through OpenSSL's records.
    let big = pattern(42, 1 << 20);
    let (answer, _) = call(&mut a, &RequestHeader::write(4, 1, 0, 1 << 20, false), &big);
    assert_eq!(answer.status(), Ok(Status::Ok));
    let (answer, data) = call(&mut a, &RequestHeader::read(5, 1, 0, 1 << 20), &[]);
    assert_eq!(answer.status(), Ok(Status::Ok));
    assert!(data == big, "1 MiB through TLS-PSK differs");
}

#[test]
fn a_psk_only_server_serves_psk_and_refuses_certificates() {
    let pki = Pki::new();
    let mut config = tls_config(&pki);
    config.tls.certificate = None;
    config.tls.key = None;
    config.tls.client_ca = None;
    config.tls.psk_file = Some(psk_file(pki.dir.path(), "server.psk", &[("A", KEY_A)]));
    let server = start(config);
    let a_keys = psk_file(pki.dir.path(), "a.psk", &[("A", KEY_A)]);
    let info = run("nbdinfo", &[&psk_uri(&server, "ns1", "A", &a_keys)]);
    assert!(info.status.success(), "PSK only: {info:?}");
    let refused = run("nbdinfo", &[&nbd_uri(&server, "ns1", &pki, "A")]);
    assert!(
        !refused.status.success(),
        "a certificate client on a PSK-only server"
    );
    let info = run("nbdinfo", &[&psk_uri(&server, "ns1", "A", &a_keys)]);
    assert!(info.status.success(), "PSK after the refusal: {info:?}");
}

/// A ClientHello record that offers a pre-shared key whose binder is garbage.
fn bogus_psk_hello() -> Vec<u8> {
    let mut body = vec![3, 3];
    body.extend([7u8; 32]); // random
    body.push(0); // session id
    body.extend([0, 2, 0x13, 0x01]); // TLS_AES_128_GCM_SHA256
    body.extend([1, 0]); // null compression
    let mut extensions = Vec::new();
    extensions.extend([0, 43, 0, 3, 2, 3, 4]); // supported_versions: TLS 1.3
    extensions.extend([0, 45, 0, 2, 1, 1]); // psk_key_exchange_modes: psk_dhe_ke
    let psk = [
        0, 5, 0, 1, b'A', 0, 0, 0, 0, 0, 33, 32, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9,
    ]; // cut identity and binder
    extensions.extend([0, 41, 0, psk.len() as u8]);
    extensions.extend(psk);
    body.extend((extensions.len() as u16).to_be_bytes());
    body.extend(extensions);
    let mut handshake = vec![1, 0];
    handshake.extend((body.len() as u16).to_be_bytes());
    handshake.extend(body);
    let mut record = vec![22, 3, 1];
    record.extend((handshake.len() as u16).to_be_bytes());
    record.extend(handshake);
    record
}

#[test]
fn cut_and_malformed_psk_handshakes_close_only_their_connection() {
    let pki = Pki::new();
    let server = psk_server(&pki);
    let hello = bogus_psk_hello();
    // Cut in the middle of the ClientHello, then closed: the server still waits to decide.
    let mut cut = TcpStream::connect(server.native_addr()).unwrap();
    cut.write_all(&hello[..hello.len() / 2]).unwrap();
    drop(cut);
    // Cut and held open: nothing comes back until it closes.
    let mut held = TcpStream::connect(server.native_addr()).unwrap();
    held.write_all(&hello[..20]).unwrap();
    // A whole hello offering a PSK with a broken binder: OpenSSL refuses it with an alert.
    let mut bogus = TcpStream::connect(server.native_addr()).unwrap();
    bogus
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    bogus.write_all(&hello).unwrap();
    let mut answer = Vec::new();
    let _ = bogus.read_to_end(&mut answer);
    assert!(
        answer.is_empty() || answer[0] == 0x15,
        "a broken PSK hello got something other than an alert: {answer:?}"
    );
    // Others are served meanwhile.
    let mut a = native_psk(server.native_addr(), "A", KEY_A);
    let (answer, _) = call(&mut a, &RequestHeader::read(1, 1, 0, 4096), &[]);
    assert_eq!(answer.status(), Ok(Status::Ok));
    drop(held);
}

#[test]
fn sighup_reloads_the_pre_shared_keys_for_new_sessions() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path();
    psk_file(path, "keys.psk", &[("A", KEY_A)]);
    let config = path.join("reflexd.toml");
    std::fs::write(
        &config,
        "port = 0\noriginal_ports = []\narena_bytes_per_thread = \"4M\"\n\
         [nbd]\nport = 0\n[nvme_tcp]\nenabled = false\n\
         [[namespace]]\nid = 1\nbackend = \"mem:4M\"\n\
         [tls]\npsk_file = \"keys.psk\"\nnbd = \"require\"\n",
    )
    .unwrap();
    let (mut child, lines) = common::spawn_reflexd(&config, false);
    let serving = common::wait_for_line(&lines, "reflexd serving");
    let nbd: SocketAddr = common::log_field(&serving, "nbd").expect("NBD address");
    let old = psk_file(path, "old.psk", &[("A", KEY_A)]);
    let new = psk_file(path, "new.psk", &[("A", KEY_B)]);
    let uri = |keys: &str| format!("nbds://A@localhost:{}/ns1?tls-psk-file={keys}", nbd.port());
    assert!(run("nbdinfo", &[&uri(&old)]).status.success());
    assert!(!run("nbdinfo", &[&uri(&new)]).status.success());

    psk_file(path, "keys.psk", &[("A", KEY_B)]);
    let status = Command::new("kill")
        .arg("-HUP")
        .arg(child.id().to_string())
        .status()
        .unwrap();
    assert!(status.success());
    common::wait_for_line(&lines, "TLS certificates reloaded");
    assert!(run("nbdinfo", &[&uri(&new)]).status.success());
    assert!(!run("nbdinfo", &[&uri(&old)]).status.success());

    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn the_client_library_speaks_tls_with_a_pre_shared_key() {
    use reflex_client::{Client, ClientError, ClientOptions, TlsOptions};
    let pki = Pki::new();
    let server = psk_server(&pki);
    let keys = psk_file(pki.dir.path(), "client.psk", &[("A", KEY_A), ("B", KEY_B)]);
    let connect = |identity: &str| {
        let options = ClientOptions {
            tls: Some(TlsOptions::from_psk_file(Path::new(&keys), identity).unwrap()),
            ..ClientOptions::default()
        };
        Client::connect_with(server.native_addr(), &options)
    };
    let mut client = connect("A").unwrap();
    let block = pattern(43, 256 * 1024);
    client.write(1, 0, &block).unwrap();
    let mut back = vec![0u8; block.len()];
    client.read(1, 0, &mut back).unwrap();
    assert!(
        back == block,
        "256 KiB through the library's TLS-PSK differs"
    );
    match client.read(2, 0, &mut back[..4096]) {
        Err(ClientError::Status { status, .. }) => assert_eq!(status, Status::Permission),
        other => panic!("tenant A read tenant B's namespace: {other:?}"),
    }
    let mut b = connect("B").unwrap();
    b.read(2, 0, &mut back[..4096]).unwrap();
    // A wrong key: the handshake fails, the connection with it.
    let wrong = ClientOptions {
        tls: Some(TlsOptions::pre_shared_key("A", &[1; 32]).unwrap()),
        ..ClientOptions::default()
    };
    assert!(Client::connect_with(server.native_addr(), &wrong).is_err());
    // An identity the file lacks is refused before connecting.
    assert!(TlsOptions::from_psk_file(Path::new(&keys), "C").is_err());
}
