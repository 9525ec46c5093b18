from services.controller.service import main

raise SystemExit(main())
