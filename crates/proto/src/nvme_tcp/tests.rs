//! Round trips of every PDU, digests, and every kind of malformed PDU header.

use super::admin::*;
use super::command::*;
use super::pdu::*;

fn decode_whole(bytes: &[u8], digests: Digests) -> Decoded {
    match decode_header(bytes, digests) {
        Ok(Some(decoded)) => decoded,
        other => panic!("expected a header, got {other:?}"),
    }
}

fn check_error(bytes: &[u8], digests: Digests, fatal: FatalError, field_offset: u32) {
    match decode_header(bytes, digests) {
        Err(error) => {
            assert_eq!(error.fatal, fatal, "{error}");
            assert_eq!(error.field_offset, field_offset, "{error}");
        }
        other => panic!("expected {fatal:?}, got {other:?}"),
    }
}

/// CRC32C's check value (the standard test vector), so the digests are the spec's.
#[test]
fn crc32c_is_castagnoli() {
    assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    assert_eq!(crc32c_append(crc32c(b"1234"), b"56789"), 0xE306_9283);
}

#[test]
fn ic_req_and_resp_round_trip() {
    let req = IcReq {
        pfv: 0,
        hpda: 0,
        digests: Digests::BOTH,
        maxr2t: 3,
    };
    let bytes = encode_ic_req(&req);
    assert_eq!(&bytes[..8], &[0, 0, 128, 0, 128, 0, 0, 0]);
    let decoded = decode_whole(&bytes, Digests::NONE);
    assert_eq!(decoded.pdu, Pdu::IcReq(req));
    assert_eq!(decoded.header_bytes, 128);
    assert_eq!(decoded.total_bytes, 128);
    let resp = IcResp {
        pfv: 0,
        cpda: 0,
        digests: Digests {
            header: true,
            data: false,
        },
        maxh2cdata: 1 << 20,
    };
    let decoded = decode_whole(&encode_ic_resp(&resp), Digests::NONE);
    assert_eq!(decoded.pdu, Pdu::IcResp(resp));
    // Fewer than 128 bytes: need more.
    assert_eq!(decode_header(&bytes[..100], Digests::NONE), Ok(None));
}

#[test]
fn capsule_with_and_without_in_capsule_data_and_digests() {
    let command = Command::io(io_opcode::WRITE, 7, 1, 8, 8, true);
    for digests in [Digests::NONE, Digests::BOTH] {
        for alignment in [0u8, 7] {
            let framing = Framing::new(digests, alignment).unwrap_or(Framing::PLAIN);
            let data = vec![0xAB_u8; 4096];
            let header = framing.capsule_cmd(&command.0, data.len() as u32);
            let mut pdu = header.as_bytes().to_vec();
            pdu.extend_from_slice(&data);
            if digests.data {
                pdu.extend_from_slice(&crc32c(&data).to_le_bytes());
            }
            let decoded = decode_whole(&pdu, digests);
            let Pdu::CapsuleCmd(sqe) = decoded.pdu else {
                panic!("{decoded:?}");
            };
            let parsed = Command(sqe);
            assert_eq!(parsed.cid(), 7);
            assert_eq!(parsed.slba(), 8);
            assert_eq!(parsed.block_count(), 8);
            assert!(parsed.fua());
            assert_eq!(decoded.total_bytes, pdu.len());
            let span = decoded.data.unwrap_or_else(|| panic!("no data"));
            assert_eq!(span.offset, header.len());
            assert_eq!(span.offset % framing.data_alignment, 0);
            assert_eq!(span.length, 4096);
            assert_eq!(span.digest, digests.data);
            assert_eq!(span.end(), pdu.len());
            // Without data.
            let header = framing.capsule_cmd(&command.0, 0);
            let decoded = decode_whole(header.as_bytes(), digests);
            assert_eq!(decoded.data, None);
            assert_eq!(decoded.header_bytes, header.len());
        }
    }
}

#[test]
fn data_pdus_and_r2t_round_trip() {
    let framing = Framing::new(Digests::BOTH, 0).unwrap_or(Framing::PLAIN);
    let data = DataHeader {
        cccid: 3,
        ttag: 9,
        offset: 4096,
        length: 8192,
    };
    for pdu_type in [PduType::H2cData, PduType::C2hData, PduType::R2t] {
        let header = framing.data_pdu(pdu_type, flags::LAST_PDU, data);
        let decoded = decode_whole(header.as_bytes(), Digests::BOTH);
        match (pdu_type, decoded.pdu) {
            (PduType::H2cData, Pdu::H2cData(got)) | (PduType::R2t, Pdu::R2t(got)) => {
                assert_eq!(got, data)
            }
            (PduType::C2hData, Pdu::C2hData(got)) => {
                assert_eq!(got, DataHeader { ttag: 0, ..data })
            }
            other => panic!("{other:?}"),
        }
        if pdu_type == PduType::R2t {
            assert_eq!(decoded.data, None);
            assert_eq!(decoded.total_bytes, DATA_HLEN + DIGEST_SIZE);
        } else {
            assert_eq!(decoded.total_bytes, DATA_HLEN + 4 + 8192 + 4);
            assert_eq!(decoded.flags & flags::LAST_PDU, flags::LAST_PDU);
        }
    }
}

#[test]
fn capsule_response_round_trips_its_completion() {
    let completion = Completion {
        dw0: 0x1234,
        dw1: 5,
        sqhd: 17,
        sqid: 2,
        cid: 99,
        status: Status::LBA_OUT_OF_RANGE,
    };
    let header = Framing::PLAIN.capsule_resp(&completion.to_bytes());
    assert_eq!(header.len(), CAPSULE_RESP_HLEN);
    let Pdu::CapsuleResp(cqe) = decode_whole(header.as_bytes(), Digests::NONE).pdu else {
        panic!("not a response");
    };
    assert_eq!(Completion::from_bytes(&cqe), completion);
    assert_eq!(
        Status::from_field(Status::ACCESS_DENIED.to_field()),
        Status::ACCESS_DENIED
    );
    // LBA out of range: SCT 0, SC 0x80, DNR.
    assert_eq!(Status::LBA_OUT_OF_RANGE.to_field(), 0x8100);
}

#[test]
fn term_req_carries_the_offending_header() {
    let error = PduError::new(FatalError::HeaderDigest, 0, "test");
    let mut out = [0u8; TERM_HLEN + TERM_DATA_MAX];
    let offending = [0x04u8; 76];
    let length = encode_term_req(true, &error, &offending, &mut out);
    assert_eq!(length, TERM_HLEN + 76);
    let decoded = decode_whole(&out[..length], Digests::BOTH);
    assert_eq!(
        decoded.pdu,
        Pdu::C2hTermReq(TermReq {
            fes: FatalError::HeaderDigest as u16,
            fei: 0
        })
    );
    assert_eq!(decoded.total_bytes, length);
    assert_eq!(decoded.header_bytes, TERM_HLEN);
}

#[test]
fn every_malformed_header_kind_is_a_typed_fatal_error() {
    let command = Command::io(io_opcode::READ, 1, 1, 0, 1, false);
    let good = Framing::new(Digests::BOTH, 0)
        .unwrap_or(Framing::PLAIN)
        .capsule_cmd(&command.0, 0);
    let good = good.as_bytes().to_vec();
    let both = Digests::BOTH;
    let invalid = FatalError::InvalidHeaderField;
    // Unknown PDU type.
    let mut bytes = good.clone();
    bytes[0] = 0x08;
    check_error(&bytes, both, invalid, 0);
    // HLEN wrong for the type.
    let mut bytes = good.clone();
    bytes[2] = 71;
    check_error(&bytes, both, invalid, 2);
    // Header digest flag missing where negotiated.
    let mut bytes = good.clone();
    bytes[1] &= !flags::HDGSTF;
    check_error(&bytes, both, invalid, 1);
    // Header digest wrong.
    let mut bytes = good.clone();
    bytes[72] ^= 1;
    check_error(&bytes, both, FatalError::HeaderDigest, 0);
    // A corrupted command byte fails the digest too.
    let mut bytes = good.clone();
    bytes[40] ^= 0x80;
    check_error(&bytes, both, FatalError::HeaderDigest, 0);
    // PLEN that disagrees with a PDU without data.
    let mut bytes = good.clone();
    bytes[4] = 200;
    check_error(&bytes, both, invalid, 4);
    // PDO inside the header.
    let mut bytes = good.clone();
    bytes[3] = 10;
    check_error(&bytes, both, invalid, 3);
    // DDGSTF on a PDU without data.
    let mut bytes = good.clone();
    bytes[1] |= flags::DDGSTF;
    check_error(&bytes, both, invalid, 1);
    // Data PDU with PDO 0.
    let data = DataHeader {
        cccid: 1,
        ttag: 1,
        offset: 0,
        length: 512,
    };
    let plain = Framing::PLAIN;
    let mut bytes = plain
        .data_pdu(PduType::H2cData, 0, data)
        .as_bytes()
        .to_vec();
    bytes[3] = 0;
    check_error(&bytes, Digests::NONE, invalid, 3);
    // DATAL disagreeing with PLEN.
    let mut bytes = plain
        .data_pdu(PduType::H2cData, 0, data)
        .as_bytes()
        .to_vec();
    bytes[16] = 0;
    bytes[17] = 4;
    check_error(&bytes, Digests::NONE, invalid, 16);
    // PLEN shorter than PDO.
    let mut bytes = plain
        .data_pdu(PduType::H2cData, 0, data)
        .as_bytes()
        .to_vec();
    bytes[4..8].copy_from_slice(&10u32.to_le_bytes());
    check_error(&bytes, Digests::NONE, invalid, 4);
    // Data digest flag not matching the negotiated one.
    let bytes = plain
        .data_pdu(PduType::H2cData, 0, data)
        .as_bytes()
        .to_vec();
    check_error(
        &bytes,
        Digests {
            header: false,
            data: true,
        },
        invalid,
        1,
    );
    // SUCCESS without LAST_PDU.
    let bytes = plain
        .data_pdu(PduType::C2hData, flags::SUCCESS, data)
        .as_bytes()
        .to_vec();
    check_error(&bytes, Digests::NONE, invalid, 1);
    // ICReq with a wrong PLEN.
    let mut bytes = encode_ic_req(&IcReq {
        pfv: 0,
        hpda: 0,
        digests: Digests::NONE,
        maxr2t: 0,
    });
    bytes[4] = 127;
    check_error(&bytes, Digests::NONE, invalid, 4);
    // Truncated input is never an error.
    for length in 0..good.len() {
        assert_eq!(decode_header(&good[..length], both), Ok(None), "{length}");
    }
}

#[test]
fn connect_data_round_trip_and_bad_nqns() {
    let data = ConnectData {
        host_id: [7; 16],
        cntlid: CNTLID_DYNAMIC,
        subsystem_nqn: "nqn.2026-01.org.reflex:ns1".into(),
        host_nqn: "nqn.2014-08.org.nvmexpress:uuid:1234".into(),
    };
    let bytes = data.encode();
    assert_eq!(ConnectData::decode(&bytes), Ok(data));
    let mut bad = bytes;
    bad[256..512].fill(b'a');
    assert_eq!(ConnectData::decode(&bad), Err(ConnectDataError::Nqn(256)));
    assert_eq!(
        ConnectData::decode(&bytes[..100]),
        Err(ConnectDataError::Length(100))
    );
    let command = Command::connect_command(1, 0, 31, CATTR_DISABLE_SQ_FLOW_CONTROL, 15_000);
    let connect = command.connect();
    assert_eq!(
        (connect.qid, connect.sqsize, connect.kato_ms),
        (0, 31, 15_000)
    );
    assert_eq!(command.opcode(), admin_opcode::FABRICS);
    assert_eq!(command.fctype(), fctype::CONNECT);
}

#[test]
fn identify_structures_round_trip() {
    let controller = IdentifyController {
        vendor_id: 0x1d1d,
        serial: "REFLEX0001".into(),
        model: "reflexd".into(),
        firmware: "0.1.0".into(),
        mdts: 8,
        cntlid: 3,
        version: 0x0001_0300,
        oaes: 1 << 8,
        controller_type: ControllerType::Io,
        aerl: 3,
        lpa: 1 << 2,
        elpe: 0,
        kas: 10,
        maxcmd: 128,
        nn: 2,
        oncs: 0b1100,
        vwc: 1,
        sgls: 1 | (1 << 20),
        subsystem_nqn: "nqn.2026-01.org.reflex:ns1".into(),
        ioccsz: 260,
        iorcsz: 1,
        msdbd: 1,
        cmic: 2,
    };
    let mut page = [0u8; IDENTIFY_SIZE];
    controller.encode(&mut page);
    assert_eq!(IdentifyController::decode(&page), controller);
    let namespace = IdentifyNamespace {
        size_blocks: 1 << 21,
        block_size_log2: 9,
        features: 1,
        nmic: 1,
        dlfeat: 0,
        nguid: [1; 16],
        eui64: [2; 8],
    };
    namespace.encode(&mut page);
    assert_eq!(IdentifyNamespace::decode(&page), namespace);
    encode_active_namespaces(&[5, 1, 3], 1, &mut page);
    assert_eq!(decode_active_namespaces(&page), vec![3, 5]);
    encode_namespace_descriptors(&[1; 16], &[2; 16], &mut page);
    assert_eq!(
        decode_namespace_descriptors(&page),
        vec![(2, vec![1; 16]), (3, vec![2; 16]), (4, vec![0])]
    );
    let entry = DiscoveryEntry {
        transport_type: discovery::TRTYPE_TCP,
        address_family: discovery::ADRFAM_IPV4,
        subsystem_type: discovery::SUBTYPE_NVM,
        transport_requirements: discovery::TREQ_NOT_REQUIRED,
        port_id: 1,
        cntlid: CNTLID_DYNAMIC,
        admin_queue_size_max: 32,
        service_id: "4420".into(),
        subsystem_nqn: "nqn.2026-01.org.reflex:ns1".into(),
        address: "127.0.0.1".into(),
        tcp_security_type: discovery::SECTYPE_TLS13,
    };
    let mut log = vec![0u8; discovery_log_size(1)];
    encode_discovery_log(4, std::slice::from_ref(&entry), &mut log);
    assert_eq!(decode_discovery_log(&log), vec![entry]);
    assert_eq!(queue_entries_max(capabilities(128, 15)), 128);
}

#[test]
fn a_capsule_whose_pdo_points_at_its_end_has_no_data() {
    // The TrueNAS Python initiator sends PDO = HLEN = PLEN on capsules without data.
    let command = Command::io(io_opcode::FLUSH, 3, 1, 0, 1, false);
    let mut bytes = Framing::PLAIN
        .capsule_cmd(&command.0, 0)
        .as_bytes()
        .to_vec();
    bytes[3] = CAPSULE_CMD_HLEN as u8;
    let decoded = decode_whole(&bytes, Digests::NONE);
    assert_eq!(decoded.data, None);
    assert_eq!(decoded.total_bytes, CAPSULE_CMD_HLEN);
    assert_eq!(decoded.header_bytes, CAPSULE_CMD_HLEN);
    // PDO beyond PLEN is still malformed.
    bytes[3] = CAPSULE_CMD_HLEN as u8 + 4;
    check_error(&bytes, Digests::NONE, FatalError::InvalidHeaderField, 4);
}
